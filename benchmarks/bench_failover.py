"""What losing the Redis primary costs a running batch under Redis Sentinel.

    python -m benchmarks.bench_failover --json benchmarks/results/failover.json

The topology of docs/failover.md on one machine (tests/support/sentinel.py): a
primary and a replica (AOF, fsync every second), three sentinels (quorum 2), real
``agentbatch worker`` processes with the DEFAULT recovery settings, the simulator as model.
For each Sentinel ``down-after-milliseconds`` given, one group runs the same batch twice:

* ``baseline``: no failure;
* ``failover``: the primary is SIGKILLed once ``--kill-at`` of the results were delivered.

From the kill (``time.monotonic()`` in this process) it measures (a) until every sentinel
names the replica as primary and the replica says it is one, (b) until the first commit on
the new primary (an agent's version in the batch's ``ver`` hash moves, polled every 10 ms
directly on the replica), (c) the batch's wall time against the baseline's. It also counts
what a failover can cost in correctness: results missing or delivered twice, and the
replication bytes the old primary had acknowledged that the replica never received.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections import Counter
from typing import Any

import redis

from agentbatch import submit_batch
from agentbatch.distributed.state.connection import sync_client
from agentbatch.distributed.state.keys import BatchKeys
from agentbatch.sim.config import SimConfig
from agentbatch.sim.process import SimProcess
from benchmarks.machine import machine_info, utc_now, write_json
from tests.support.pure_tools import stamp
from tests.support.sentinel import SentinelGroup
from tests.support.workers import WorkerProcess

TASK = 'Agent {i}.\n@sim tool stamp {{"key": "k{i}"}}'  # two model turns, one tool call


def _workers(url: str, n: int, concurrency: int) -> list[WorkerProcess]:
    """Workers with the shipped recovery settings (the test helper's short ones removed)."""
    workers = []
    for i in range(n):
        w = WorkerProcess(url, name=f"fo{i}", concurrency=concurrency,
                          env={"AGENTBATCH_WORKER_IMPORTS": "tests.support.pure_tools"})
        for name in ("AGENTBATCH_SWEEP_INTERVAL_S", "AGENTBATCH_LEASE_TTL_S",
                     "AGENTBATCH_QUEUE_GRACE_S"):
            w.env.pop(name, None)
        workers.append(w)
    for w in workers:
        w.start(wait=False)
    for w in workers:
        w.wait_ready()
    return workers


def _run(url: str, backend: str, agents: int, timeout: float,
         on_delivered: Any = None) -> dict[str, Any]:
    """One batch, read to the end; ``on_delivered(batch_id, n)`` after each result."""
    t0 = time.monotonic()
    handle = submit_batch(TASK, [{"i": i} for i in range(agents)], backend=backend,
                          model="sim-model", tools=[stamp], redis_url=url)
    seen: Counter[int] = Counter()
    failed = 0
    times: list[float] = []
    read_ids: list[str] = []
    for result in handle.results(timeout=timeout):
        seen[result.index] += 1
        failed += not result.ok
        times.append(time.monotonic())
        read_ids.append(handle.cursor)
        if on_delivered is not None:
            on_delivered(handle.batch_id, sum(seen.values()))
    wall = time.monotonic() - t0
    status = handle.status()
    # results this reader got that the (new) primary does not hold: writes the old primary
    # acknowledged and never replicated (the agent ran again and wrote its result again)
    stored = {entry_id for entry_id, _ in sync_client(url).xrange(BatchKeys(handle.batch_id)
                                                                   .results)}
    return {"batch_id": handle.batch_id, "wall_s": round(wall, 3), "delivered": len(times),
            "missing": len(set(range(agents)) - set(seen)),
            "delivered_twice": sum(1 for n in seen.values() if n > 1), "failed": failed,
            "read_from_unreplicated_writes": sum(1 for i in read_ids if i not in stored),
            "stream_entries": len(stored),
            "stats": {k: v for k, v in status.items() if k.startswith("stat:")
                      or k in ("recovering",)},
            "_times": times}


class CommitWatch(threading.Thread):
    """Polls the versions in the replica's copy of the batch's ``state`` hash; ``first_s`` =
    seconds from the kill to the first change (a commit on the promoted replica)."""

    def __init__(self, port: int, batch_id: str, killed: float, timeout: float) -> None:
        super().__init__(daemon=True)
        self.client = redis.Redis(port=port, socket_timeout=1, decode_responses=True)
        self.key = BatchKeys(batch_id).state
        self.killed, self.timeout = killed, timeout
        self.first_s: float | None = None

    def _sum(self) -> int:
        return sum(int(v.partition(":")[0]) for v in self.client.hvals(self.key))

    def run(self) -> None:
        time.sleep(0.2)  # the replica applies what it had buffered before the kill
        before = self._sum()
        while time.monotonic() < self.killed + self.timeout:
            try:
                if self._sum() != before:
                    self.first_s = time.monotonic() - self.killed
                    return
            except redis.RedisError:
                pass
            time.sleep(0.01)


def one_setting(down_after_ms: int, args: argparse.Namespace, backend: str) -> dict[str, Any]:
    group = SentinelGroup(down_after_ms=down_after_ms).start()
    workers: list[WorkerProcess] = []
    try:
        workers = _workers(group.url, args.workers, args.concurrency)
        baseline = _run(group.url, backend, args.agents, args.timeout)
        primary = redis.Redis(port=group.primary_port, socket_timeout=1)
        replica = redis.Redis(port=group.replica_port, socket_timeout=1,
                              decode_responses=True)
        event: dict[str, Any] = {}

        def on_delivered(batch_id: str, n: int) -> None:
            if "killed" in event or n < args.kill_at * args.agents:
                return
            event["primary_offset"] = int(primary.info("replication")["master_repl_offset"])
            event["killed"] = group.kill_primary()
            event["delivered_at_kill"] = n
            event["promo_thread"] = threading.Thread(
                target=lambda: event.__setitem__("promoted", group.wait_promoted(120)),
                daemon=True)
            event["promo_thread"].start()
            event["watch"] = CommitWatch(group.replica_port, batch_id, event["killed"], 300)
            event["watch"].start()
            time.sleep(0.05)  # the replica has applied all it received (nothing more comes)
            event["replica_offset"] = int(replica.info("replication")["master_repl_offset"])

        failover = _run(group.url, backend, args.agents, args.timeout, on_delivered)
        event["promo_thread"].join(130)
        event["watch"].join(310)
        killed = event["killed"]
        after = [t - killed for t in failover.pop("_times") if t > killed]
        baseline.pop("_times")
        return {
            "down_after_ms": down_after_ms,
            "baseline": baseline,
            "failover": failover,
            "delivered_at_kill": event["delivered_at_kill"],
            "promotion_s": round(event["promoted"] - killed, 3) if "promoted" in event
            else None,
            "first_commit_after_kill_s": None if event["watch"].first_s is None
            else round(event["watch"].first_s, 3),
            "first_result_after_kill_s": round(after[0], 3) if after else None,
            "extra_wall_s": round(failover["wall_s"] - baseline["wall_s"], 3),
            "unreplicated_bytes_at_kill": max(0, event["primary_offset"]
                                              - event["replica_offset"]),
            "workers_alive": sum(w.alive for w in workers),
        }
    finally:
        for w in workers:
            w.stop(timeout=15)
        group.cleanup()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_failover")
    p.add_argument("--agents", type=int, default=300)
    p.add_argument("--model-ms", type=float, default=150.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--kill-at", type=float, default=0.25,
                   help="fraction of results delivered when the primary is killed")
    p.add_argument("--down-after-ms", type=int, nargs="+", default=[1000, 5000],
                   help="Sentinel down-after-milliseconds values, one group each")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    started = utc_now()
    with SimProcess(SimConfig(fixed_ms=args.model_ms)) as sim:
        backend = "sim://" + sim.url.split("://", 1)[1]
        runs = [one_setting(d, args, backend) for d in args.down_after_ms]
    data = {
        "benchmark": "failover", "created": utc_now(), "started": started,
        "command": "python -m benchmarks.bench_failover " + " ".join(argv or []),
        "machine": machine_info(),
        "settings": {"agents": args.agents, "model_ms": args.model_ms,
                     "workers": args.workers, "concurrency": args.concurrency,
                     "kill_at": args.kill_at, "task": TASK,
                     "worker_env": "shipped defaults (lease, queue grace, sweep)",
                     "topology": "primary + 1 replica (appendonly, fsync everysec), "
                                 "3 sentinels, quorum 2, failover-timeout 10 s",
                     "pid": os.getpid()},
        "runs": runs,
    }
    for run in runs:
        print(f"down-after {run['down_after_ms']} ms: promotion {run['promotion_s']} s, first "
              f"commit {run['first_commit_after_kill_s']} s, wall {run['failover']['wall_s']} "
              f"vs {run['baseline']['wall_s']} s, missing {run['failover']['missing']}, "
              f"twice {run['failover']['delivered_twice']}")
    if args.json:
        write_json(args.json, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
