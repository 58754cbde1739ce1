"""Chaos harness: run a distributed batch while killing workers and the submitter.

It runs 1,000 agents x 3 tool rounds (by default) on the simulator with 4 inference-worker and
2 tool-worker processes, SIGKILLs a random worker every few seconds (and restarts it), SIGKILLs
the submitting process mid-run and re-attaches from a new one, then checks the invariants
against Redis itself and writes a JSON report. The same batch without chaos runs first, in
the same invocation, so the report gives the overhead of the kills.

    python -m tests.chaos.harness --agents 1000 --json benchmarks/results/chaos_1000.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
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

from agentbatch.sim.config import SimConfig
from agentbatch.sim.process import SimProcess
from agentbatch.state.keys import BatchKeys
from tests.support.redis_server import RedisServer
from tests.support.workers import REPO, WorkerProcess


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
    submitter_killed_at_s: float | None = None
    tail_after_last_kill_s: float | None = None
    stuck_bound_s: float | None = None
    versions_strictly_increasing: bool = True
    commits_audited: int = 0
    turns_applied_twice: int = 0
    cacheable_keys: int = 0
    cacheable_reruns: int = 0
    shared_noncacheable_executions: int = 0
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

    def killer() -> None:
        interval = cfg.kill_interval_s or max((expected_wall or 30.0) / (cfg.min_kills + 3),
                                              0.5)
        while not done.wait(rng.uniform(0.6 * interval, 1.2 * interval)):
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
    data = json.loads(collected.read_text())
    report.reader_error = data["raised"] if collector.returncode else None
    _check(report, r, batch_id, cfg, data["rows"])
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
    meta = r.hgetall(k.meta)
    report.redeliveries_dropped = {key[5:]: int(v) for key, v in meta.items()
                                   if key.startswith("stat:dropped")}
    report.recovered_by_sweep = int(meta.get("stat:recovered", 0))


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
