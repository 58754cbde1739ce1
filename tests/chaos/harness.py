"""Chaos harness: run a distributed batch while killing workers and the submitter.

It runs 1,000 agents x 3 tool rounds (by default) on the simulator with 4 inference-worker and
2 tool-worker processes, SIGKILLs a random worker every few seconds, or sooner once the next
share of the agents is delivered, so a fast batch still gets its faults while it runs (and
restarts it), pauses one past its lease now and then (SIGSTOP, then SIGCONT), pushes
malformed messages onto both queues, runs a batch the workers cannot open beside the real
one, has a few agents hit a bug inside ``step()``, SIGKILLs the submitting process mid-run
and re-attaches from a new one, then checks the invariants against Redis itself and writes a
JSON report, with the p99 time
from a worker fault to the next commit of each agent the sweep recovered. The same batch
without chaos runs first, in the same invocation, so the report gives the overhead of the
kills.

    python -m tests.chaos.harness --agents 1000 --json benchmarks/results/chaos_1000.json
"""

from __future__ import annotations

import argparse
import base64
import gzip
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis

from agentbatch import submit_batch
from agentbatch.distributed.handle import DistributedHandle
from agentbatch.distributed.state.keys import BatchKeys
from agentbatch.distributed.workers.app import INFERENCE_QUEUE, TOOLS_QUEUE, TURN_TASK, client_app
from agentbatch.distributed.workers.envelope import envelope
from agentbatch.sim.config import SimConfig
from agentbatch.sim.process import SimProcess
from tests.chaos.client import dup_id_agents, step_bug_agents
from tests.support.redis_server import RedisServer
from tests.support.workers import REPO, WorkerProcess

UNLOADABLE_AGENTS = 20
PROGRESS_POLL_S = 0.05  # how often the fault timer also looks at the batch's progress


def faults_for_kills(min_kills: int, pause_every: int) -> int:
    """How many faults make ``min_kills`` kills when every ``pause_every``-th is a pause."""
    n = min_kills
    while pause_every and n - n // pause_every < min_kills:
        n += 1
    return n


@dataclass
class ChaosConfig:
    agents: int = 1000
    inference_workers: int = 4
    tool_workers: int = 2
    concurrency: int = 16
    min_kills: int = 10
    kill_interval_s: float = 0.0  # 0: spread min_kills over the no-chaos run's wall time
    kill_submitter: bool = True
    fixed_ms: float = 20.0
    tool_sleep_s: float = 0.05
    lease_ttl_s: float = 3.0
    queue_grace_s: float = 5.0
    sweep_interval_s: float = 0.5
    fault_rates: str = ""
    compare_without_chaos: bool = True
    timeout_s: float = 1200.0
    seed: int = 7
    pause_every: int = 3  # every Nth fault is a SIGSTOP past the lease, then SIGCONT (0: none)
    poison: bool = True  # malformed messages on each queue while the batch runs
    unloadable_batch: bool = True  # a batch the workers cannot open, beside the real one


@dataclass
class RunReport:
    chaos: bool
    wall_s: float = 0.0
    delivered: int = 0
    lost: int = 0
    duplicated: int = 0
    ok: int = 0
    failed_by_kind: dict[str, int] = field(default_factory=dict)
    latency_p50_s: float | None = None
    latency_p99_s: float | None = None
    kill_times_s: list[float] = field(default_factory=list)
    kills: int = 0
    pause_times_s: list[float] = field(default_factory=list)
    pauses: int = 0
    poison_messages: int = 0
    step_bug_agents: int = 0
    step_bugs_ended_internal: int = 0
    dup_id_agents: int = 0  # agents whose reply carried two tool calls with one id
    recovery_slowest_s: list[float | None] = field(default_factory=list)
    dup_id_agents_ok: int = 0
    unloadable_agents: int = 0
    unloadable_ended_with_reason: int = 0
    resends: int = 0
    recovery_p50_s: float | None = None
    recovery_p99_s: float | None = None
    recovery_max_s: float | None = None
    submitter_killed_at_s: float | None = None
    tail_after_last_kill_s: float | None = None
    stuck_bound_s: float | None = None
    versions_strictly_increasing: bool = True
    commits_audited: int = 0
    turns_applied_twice: int = 0
    cacheable_keys: int = 0
    cacheable_reruns: int = 0
    shared_noncacheable_executions: int = 0
    noncacheable_calls: int = 0  # distinct non-cacheable calls that ran (idempotency keys)
    noncacheable_executions: int = 0  # how often they ran: at-least-once, so maybe more
    noncacheable_reruns: int = 0
    redeliveries_dropped: dict[str, int] = field(default_factory=dict)
    recovered_by_sweep: int = 0
    workers_died_unexpectedly: int = 0
    reader_error: str | None = None


def _env(cfg: ChaosConfig) -> dict[str, str]:
    return {
        "AGENTBATCH_LEASE_TTL_S": str(cfg.lease_ttl_s),
        "AGENTBATCH_QUEUE_GRACE_S": str(cfg.queue_grace_s),
        "AGENTBATCH_SWEEP_INTERVAL_S": str(cfg.sweep_interval_s),
        "AGENTBATCH_AUDIT": "1",
        "TEST_TOOL_SLEEP_S": str(cfg.tool_sleep_s),
    }


class Fleet:
    """The worker processes; a killed one is replaced by a fresh process with the same role."""

    def __init__(self, redis_url: str, cfg: ChaosConfig) -> None:
        self.redis_url = redis_url
        self.cfg = cfg
        self.workers: list[WorkerProcess] = []
        self.serial = 0

    def _spawn(self, queues: str, wait: bool) -> WorkerProcess:
        self.serial += 1
        w = WorkerProcess(self.redis_url, queues=queues, concurrency=self.cfg.concurrency,
                          name=f"{queues}-{self.serial}", env=_env(self.cfg))
        return w.start(wait=wait)

    def start(self) -> None:
        roles = ["inference"] * self.cfg.inference_workers + ["tools"] * self.cfg.tool_workers
        self.workers = [self._spawn(q, wait=False) for q in roles]
        for w in self.workers:
            w.wait_ready()

    def pause_random(self, rng: random.Random, seconds: float) -> str:
        """SIGSTOP a worker past its lease, then SIGCONT it: a paused process that wakes up."""
        victim = rng.choice(self.workers)
        if victim.proc is None or victim.proc.poll() is not None:
            return victim.name
        os.kill(victim.proc.pid, signal.SIGSTOP)

        def wake() -> None:
            if victim.proc is not None and victim.proc.poll() is None:
                os.kill(victim.proc.pid, signal.SIGCONT)

        threading.Timer(seconds, wake).start()
        return victim.name

    def kill_random(self, rng: random.Random) -> str:
        victim = rng.choice(self.workers)
        victim.kill()
        self.workers.remove(victim)
        self.workers.append(self._spawn(victim.queues, wait=False))
        return victim.name

    def stop(self) -> int:
        died = sum(1 for w in self.workers if w.proc is not None and w.proc.poll() is not None)
        for w in self.workers:
            w.stop(timeout=30)
        return died


def _client(mode: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "tests.chaos.client", mode, *args]


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run_once(cfg: ChaosConfig, redis_url: str, backend: str, chaos: bool,
             rng: random.Random, expected_wall: float | None) -> RunReport:
    report = RunReport(chaos=chaos)
    r = redis.from_url(redis_url, decode_responses=True)
    r.flushdb()
    fleet = Fleet(redis_url, cfg)
    fleet.start()
    tmp = Path(tempfile.mkdtemp(prefix="agentbatch-chaos-"))
    submit_log = tmp / "submitted.log"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    started = time.monotonic()
    submitter = subprocess.Popen(
        _client("submit", "--redis-url", redis_url, "--backend", backend, "--agents",
                str(cfg.agents), "--out", str(submit_log)), env=env, cwd=REPO)
    id_file = submit_log.with_suffix(".id")
    while not (id_file.exists() and id_file.read_text().strip()):
        if submitter.poll() is not None:
            raise RuntimeError("the submitting process exited before submitting")
        time.sleep(0.05)
    batch_id = id_file.read_text().strip()
    done = threading.Event()
    if chaos and cfg.poison:
        report.poison_messages = push_poison(r)
    broken = submit_unloadable(redis_url, backend, tmp) if chaos and cfg.unloadable_batch \
        else None

    faults_wall: list[float] = []  # time.time() of each kill or pause, for recovery times

    events = faults_for_kills(cfg.min_kills, cfg.pause_every)
    meta_key = BatchKeys(batch_id).meta

    def due_by_progress(n: int) -> bool:
        """Fault ``n + 1`` is due once ``n + 1`` shares of the agents are delivered (the
        ``events`` faults spread over the batch): a batch that runs faster than the timer
        still gets its faults while it runs, not after it ended."""
        delivered = int(r.hget(meta_key, "delivered") or 0)
        return delivered >= (n + 1) * cfg.agents / (events + 1)

    def killer() -> None:
        interval = cfg.kill_interval_s or max((expected_wall or 30.0) / (cfg.min_kills + 3),
                                              0.5)
        n = 0
        while not done.is_set():
            at = time.monotonic() + rng.uniform(0.6 * interval, 1.2 * interval)
            while not done.wait(PROGRESS_POLL_S):
                if time.monotonic() >= at or (n < events and due_by_progress(n)):
                    break
            if done.is_set():
                break
            n += 1
            faults_wall.append(time.time())
            if cfg.pause_every and n % cfg.pause_every == 0:
                fleet.pause_random(rng, cfg.lease_ttl_s * 1.5)
                report.pause_times_s.append(round(time.monotonic() - started, 3))
            else:
                fleet.kill_random(rng)
                report.kill_times_s.append(round(time.monotonic() - started, 3))

    killer_thread = threading.Thread(target=killer, daemon=True)
    if chaos:
        killer_thread.start()
    if chaos and cfg.kill_submitter:
        target = max(cfg.agents // 4, 1)
        while submitter.poll() is None:
            seen = len(submit_log.read_text().splitlines()) if submit_log.exists() else 0
            if seen >= target:
                submitter.kill()
                report.submitter_killed_at_s = round(time.monotonic() - started, 3)
                break
            time.sleep(0.05)
    else:
        submitter.kill()
    submitter.wait(30)
    collected = tmp / "collected.json"
    collector = subprocess.run(
        _client("collect", "--redis-url", redis_url, "--batch-id", batch_id, "--out",
                str(collected), "--timeout", str(cfg.timeout_s)), env=env, cwd=REPO,
        timeout=cfg.timeout_s + 60)
    report.wall_s = round(time.monotonic() - started, 3)
    done.set()
    if chaos:
        killer_thread.join(30)
    report.kills = len(report.kill_times_s)
    report.pauses = len(report.pause_times_s)
    data = json.loads(collected.read_text())
    report.reader_error = data["raised"] if collector.returncode else None
    _check(report, r, batch_id, cfg, data["rows"])
    _recovery(report, r, batch_id, faults_wall)
    if broken is not None:
        ended = broken.wait(timeout=120)
        report.unloadable_agents = len(ended)
        report.unloadable_ended_with_reason = sum(
            1 for res in ended if not res.ok and res.error.kind == "config")
    report.workers_died_unexpectedly = fleet.stop()
    if report.kill_times_s:
        report.tail_after_last_kill_s = round(report.wall_s - report.kill_times_s[-1], 3)
    return report


def _check(report: RunReport, r: redis.Redis, batch_id: str, cfg: ChaosConfig,
           rows: list[dict[str, Any]]) -> None:
    k = BatchKeys(batch_id)
    entries = r.xrange(k.results)
    per_agent = Counter(int(f["i"]) for _, f in entries)
    report.delivered = len(per_agent)
    report.lost = cfg.agents - len(per_agent)
    report.duplicated = sum(n - 1 for n in per_agent.values() if n > 1)
    read = Counter(row["index"] for row in rows)
    report.duplicated += sum(n - 1 for n in read.values() if n > 1)
    report.ok = sum(row["ok"] for row in rows)
    report.failed_by_kind = dict(Counter(row["error"]["kind"] for row in rows if not row["ok"]))
    latencies = [row["latency_s"] for row in rows if row["latency_s"] is not None]
    report.latency_p50_s = _percentile(latencies, 0.5)
    report.latency_p99_s = _percentile(latencies, 0.99)
    versions: dict[int, list[int]] = defaultdict(list)
    for _, f in r.xrange(k.audit):
        if "v" in f:  # re-send records carry "resent" instead
            versions[int(f["i"])].append(int(f["v"]))
    report.commits_audited = sum(len(v) for v in versions.values())
    for seq in versions.values():
        if seq != list(range(1, len(seq) + 1)):
            report.versions_strictly_increasing = False
        report.turns_applied_twice += len(seq) - len(set(seq))
    cached = {key: int(v) for key, v in _scan(r, "test:exec:cached_lookup:*")}
    report.cacheable_keys = len(cached)
    report.cacheable_reruns = sum(v - 1 for v in cached.values())
    report.shared_noncacheable_executions = sum(
        int(v) for key, v in _scan(r, "test:exec:lookup:s*"))
    runs = [int(v) for v in r.hvals("test:exec:noncacheable")]
    report.noncacheable_calls = len(runs)
    report.noncacheable_executions = sum(runs)
    report.noncacheable_reruns = sum(runs) - len(runs)
    meta = r.hgetall(k.meta)
    report.redeliveries_dropped = {key[5:]: int(v) for key, v in meta.items()
                                   if key.startswith("stat:dropped")}
    report.recovered_by_sweep = int(meta.get("stat:recovered", 0))
    report.step_bug_agents = step_bug_agents(cfg.agents)
    report.step_bugs_ended_internal = sum(
        1 for row in rows if not row["ok"] and row["error"]["kind"] == "internal"
        and "boom" in row["error"]["message"])
    dup = set(dup_id_agents(cfg.agents))
    report.dup_id_agents = len(dup)
    report.dup_id_agents_ok = sum(1 for row in rows if row["index"] in dup and row["ok"])


def _recovery(report: RunReport, r: redis.Redis, batch_id: str,
              faults_wall: list[float]) -> None:
    """For each agent the sweep re-sent: time from the latest worker fault (kill or pause)
    before the re-send to the agent's next commit (the audit stream's ids are Redis times)."""
    commits: dict[int, list[float]] = defaultdict(list)
    resends: list[tuple[float, int]] = []
    for entry_id, f in r.xrange(BatchKeys(batch_id).audit):
        at = int(entry_id.split("-")[0]) / 1000
        if "resent" in f:
            resends.append((at, int(f["i"])))
        else:
            commits[int(f["i"])].append(at)
    report.resends = len(resends)
    times = []
    for at, index in resends:
        before = [t for t in faults_wall if t <= at]
        after = [t for t in commits[index] if t >= at]
        if before and after:
            times.append(after[0] - before[-1])
    report.recovery_p50_s = _round(_percentile(times, 0.5))
    report.recovery_p99_s = _round(_percentile(times, 0.99))
    report.recovery_max_s = _round(max(times) if times else None)
    report.recovery_slowest_s = [_round(t) for t in sorted(times, reverse=True)[:10]]


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def push_poison(r: redis.Redis) -> int:
    """Malformed messages on both queues: not JSON, a JSON envelope whose body is ``[]``, and
    a body that claims gzip compression. Each must be dead-lettered, never kill a worker."""
    app = client_app("redis://unused")
    pushed = 0
    for queue in (INFERENCE_QUEUE, TOOLS_QUEUE):
        key, payload = envelope(app, TURN_TASK, ["x", 0, 0, 0], queue, 9)
        bad_body = json.loads(payload)
        bad_body["body"] = base64.b64encode(b"[]").decode()
        zipped = json.loads(payload)
        zipped["headers"]["compression"] = "application/x-gzip"
        zipped["body"] = base64.b64encode(gzip.compress(b"\0" * 1_000_000)).decode()
        for item in ("not json at all", json.dumps(bad_body), json.dumps(zipped)):
            r.lpush(key, item)
            pushed += 1
    return pushed


def submit_unloadable(redis_url: str, backend: str, tmp: Path) -> DistributedHandle:
    """A small batch whose backend hostfile the workers cannot read: it must end with kind
    ``config`` while the main batch runs on."""
    hostfile = tmp / "gone-hosts.txt"
    hostfile.write_text(backend + "\n")
    handle = submit_batch("Broken {i}.", [{"i": i} for i in range(UNLOADABLE_AGENTS)],
                          model="sim-model", backend=f"@{hostfile}", redis_url=redis_url,
                          warm_prefix=False)
    hostfile.unlink()
    return handle  # type: ignore[return-value]


def _scan(r: redis.Redis, pattern: str) -> list[tuple[str, str]]:
    keys = list(r.scan_iter(pattern, count=1000))
    return list(zip(keys, r.mget(keys), strict=True)) if keys else []


def run(cfg: ChaosConfig) -> dict[str, Any]:
    rng = random.Random(cfg.seed)
    server = RedisServer().start()
    sim = SimProcess(SimConfig(fixed_ms=cfg.fixed_ms, fault_rates=cfg.fault_rates or {},
                               seed=cfg.seed, timeout_hold_s=10.0)).start()
    backend = "sim://" + sim.url.split("://", 1)[1]
    try:
        baseline = None
        if cfg.compare_without_chaos:
            baseline = run_once(cfg, server.url, backend, False, rng, None)
        chaos = run_once(cfg, server.url, backend, True, rng,
                         baseline.wall_s if baseline else None)
    finally:
        sim.stop()
        server.cleanup()
    if baseline and baseline.latency_p99_s is not None:
        chaos.stuck_bound_s = round(cfg.lease_ttl_s + cfg.queue_grace_s + cfg.sweep_interval_s
                                    + baseline.latency_p99_s, 3)
    verdict = {
        "exactly_once": chaos.lost == 0 and chaos.duplicated == 0,
        "no_turn_applied_twice": chaos.versions_strictly_increasing
        and chaos.turns_applied_twice == 0,
        "no_agent_stuck": (chaos.tail_after_last_kill_s is None or chaos.stuck_bound_s is None
                           or chaos.tail_after_last_kill_s <= chaos.stuck_bound_s),
        "enough_kills": chaos.kills >= cfg.min_kills,
        "every_agent_ended_ok_or_with_reason": chaos.ok + sum(chaos.failed_by_kind.values())
        == cfg.agents,
        "step_bugs_ended_internal": chaos.step_bugs_ended_internal == chaos.step_bug_agents,
        "duplicate_tool_ids_ended_ok": chaos.dup_id_agents_ok == chaos.dup_id_agents,
        "unloadable_batch_ended": chaos.unloadable_ended_with_reason
        == chaos.unloadable_agents,
        "no_worker_died_unexpectedly": chaos.workers_died_unexpectedly == 0,
        "reader_finished": chaos.reader_error is None,
    }
    return {
        "benchmark": "chaos",
        "config": asdict(cfg),
        "machine": {"cores": os.cpu_count(), "python": platform.python_version()},
        "without_chaos": asdict(baseline) if baseline else None,
        "with_chaos": asdict(chaos),
        "kill_overhead_ratio": round(chaos.wall_s / baseline.wall_s, 3) if baseline else None,
        "invariants": verdict,
        "passed": all(verdict.values()),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in ChaosConfig.__dataclass_fields__.values():
        default = f.default
        kind = type(default) if not isinstance(default, bool) else None
        flag = "--" + f.name.replace("_", "-")
        if kind is None:
            p.add_argument(flag, type=lambda s: s.lower() in ("1", "true", "yes"),
                           default=default)
        else:
            p.add_argument(flag, type=kind, default=default)
    p.add_argument("--json", default="benchmarks/results/chaos_1000.json")
    args = vars(p.parse_args(argv))
    out = Path(args.pop("json"))
    report = run(ChaosConfig(**args))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"invariants": report["invariants"], "passed": report["passed"],
                      "kill_overhead_ratio": report["kill_overhead_ratio"]}, indent=2))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
