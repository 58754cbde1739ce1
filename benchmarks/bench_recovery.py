"""How long a SIGKILLed worker's in-flight work waits before another worker resumes it, with
the DEFAULT recovery settings (lease TTL, queue grace and sweep interval left unset).

    python -m benchmarks.bench_recovery --json benchmarks/results/recovery_default.json

Two scenarios, each on a throwaway redis-server, the simulator and real worker processes:

* ``turn``: worker A holds every agent's model turn (the simulator answers after
  ``--model-ms``); a second inference worker is up; A is SIGKILLed. Recovery of an agent is
  the time from the kill until another worker holds its turn's lease (a new lease token).
* ``tool``: worker A runs every agent's tool call (a ``lookup`` that sleeps ``--tool-s``);
  a second tool worker is up; A is SIGKILLed. Recovery is the time from the kill until the
  call starts again (the tool's own execution counter in Redis reaches 2).

Only Redis keys and the public API are read, so the same file measures an older checkout:
``PYTHONPATH=/path/to/old/checkout python -m benchmarks.bench_recovery`` from that checkout
(the workers import ``agentbatch`` and ``tests.support`` from the same path). The bound to
compare with is the one the code states: ``2 x lease TTL + sweep interval``.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from agentbatch import submit_batch
from agentbatch.sim.config import SimConfig
from agentbatch.sim.process import SimProcess
from benchmarks.machine import machine_info, utc_now, write_json
from tests.support.redis_server import RedisServer
from tests.support.tools import lookup

REPO = Path(__file__).resolve().parents[1]
# The shipped defaults, read from the code under test (absent in older checkouts: None).
try:
    from agentbatch.distributed.workers.settings import WorkerSettings

    DEFAULTS: dict[str, Any] = {
        "lease_ttl_s": WorkerSettings.lease_ttl_s,
        "queue_grace_s": WorkerSettings.queue_grace_s,
        "sweep_interval_s": WorkerSettings.sweep_interval_s,
    }
except Exception:  # an old checkout without these fields
    DEFAULTS = {}


class Worker:
    """``agentbatch worker`` with nothing but the URL and the import allowlist set."""

    def __init__(self, url: str, queues: str, name: str, env: dict[str, str]) -> None:
        self.log = Path(tempfile.mkstemp(prefix=f"recovery-{name}-", suffix=".log")[1])
        clean = {k: v for k, v in os.environ.items()
                 if not k.startswith("AGENTBATCH_") or k == "AGENTBATCH_WORKER_IMPORTS"}
        self.env = {**clean, "PYTHONPATH": str(REPO), "AGENTBATCH_REDIS_URL": url,
                    "AGENTBATCH_WORKER_IMPORTS": "tests.support", **env}
        self.cmd = [sys.executable, "-m", "agentbatch.cli", "worker", "--queues", queues,
                    "--concurrency", "8", "--redis-url", url, "--hostname", f"{name}@%h"]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Worker:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=out,
                                         stderr=subprocess.STDOUT, cwd=REPO)
        deadline = time.monotonic() + 60
        while b" ready." not in self.log.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker did not start: {self.log.read_text()[-2000:]}")
            time.sleep(0.1)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


def _wait(pred: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _kill_and_time(victim: Worker, agents: int, timeout: float,
                   resumed: Callable[[int], bool]) -> list[float]:
    """SIGKILL ``victim``; for each agent, seconds until ``resumed(i)`` (inf: not in time)."""
    t0 = time.monotonic()
    victim.kill()
    recovered: dict[int, float] = {}
    while len(recovered) < agents and time.monotonic() < t0 + timeout:
        for i in range(agents):
            if i not in recovered and resumed(i):
                recovered[i] = time.monotonic() - t0
        time.sleep(0.05)
    return [recovered.get(i, float("inf")) for i in range(agents)]


def _lease(batch_id: str, index: int) -> str:
    return f"ab:{{{batch_id}}}:lease:{index}"


def run_turn(url: str, backend: str, agents: int, timeout: float) -> list[float]:
    r = redis.from_url(url, decode_responses=True)
    r.flushdb()
    a = Worker(url, "inference,tools", "a", {}).start()
    handle = submit_batch("Agent {i}: say hi.", [{"i": i} for i in range(agents)],
                          model="sim-model", backend=backend, redis_url=url)
    leases = [_lease(handle.batch_id, i) for i in range(agents)]
    try:
        _wait(lambda: all(r.get(k) for k in leases), 60, "worker A to hold every turn")
        before = [r.get(k) for k in leases]
        b = Worker(url, "inference,tools", "b", {}).start()
        try:
            return _kill_and_time(a, agents, timeout,
                                  lambda i: r.get(leases[i]) not in (None, before[i]))
        finally:
            b.kill()  # its resumed turns would run the full model latency again
    finally:
        a.kill()
        handle.cancel()


def run_tool(url: str, backend: str, agents: int, tool_s: float,
             timeout: float) -> list[float]:
    r = redis.from_url(url, decode_responses=True)
    r.flushdb()
    slow = {"TEST_TOOL_SLEEP_S": str(tool_s)}
    inference = Worker(url, "inference", "inf", {}).start()
    a = Worker(url, "tools", "a", slow).start()
    task = 'Agent {i}.\n@sim tool lookup {{"key": "k{i}"}}\n'
    handle = submit_batch(task, [{"i": i} for i in range(agents)], tools=[lookup],
                          model="sim-model", backend=backend, redis_url=url)
    counters = [f"test:exec:lookup:k{i}" for i in range(agents)]
    try:
        _wait(lambda: all(r.get(k) for k in counters), 60, "worker A to run every tool call")
        b = Worker(url, "tools", "b", {"TEST_TOOL_SLEEP_S": "0.1"}).start()
        try:
            return _kill_and_time(a, agents, timeout,
                                  lambda i: int(r.get(counters[i]) or 0) >= 2)
        finally:
            b.kill()
    finally:
        a.kill()
        inference.kill()
        handle.cancel()


def summary(values: list[float]) -> dict[str, Any]:
    finite = sorted(v for v in values if v != float("inf"))
    return {
        "agents": len(values),
        "recovered": len(finite),
        "p50_s": round(statistics.median(finite), 2) if finite else None,
        "max_s": round(finite[-1], 2) if finite else None,
        "values_s": [round(v, 2) if v != float("inf") else None for v in values],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--model-ms", type=float, default=60_000,
                    help="simulated model latency: the turn is still in flight at the kill")
    ap.add_argument("--tool-s", type=float, default=600.0,
                    help="tool duration on the killed worker: still running at the kill")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="give up on recovery after this many seconds (reported as None)")
    ap.add_argument("--scenarios", default="turn,tool")
    ap.add_argument("--label", default="current")
    ap.add_argument("--json", default="benchmarks/results/recovery_default.json")
    args = ap.parse_args(argv)
    report: dict[str, Any] = {"benchmark": "recovery_default", "label": args.label,
                              "created": utc_now(), "machine": machine_info(),
                              "defaults": DEFAULTS, "config": vars(args), "scenarios": {}}
    if DEFAULTS:
        report["bound_s"] = 2 * DEFAULTS["lease_ttl_s"] + DEFAULTS["sweep_interval_s"]
    server = RedisServer().start()
    try:
        for name in args.scenarios.split(","):
            # the tool scenario's model turns are quick; only the turn scenario's are slow
            ms = args.model_ms if name == "turn" else 5.0
            with SimProcess(SimConfig(fixed_ms=ms)) as sim:
                backend = "sim://" + sim.url.split("://", 1)[1]
                if name == "turn":
                    values = run_turn(server.url, backend, args.agents, args.timeout)
                else:
                    values = run_tool(server.url, backend, args.agents, args.tool_s,
                                      args.timeout)
            report["scenarios"][name] = summary(values)
            print(name, report["scenarios"][name], flush=True)
    finally:
        server.cleanup()
    report["finished"] = utc_now()
    print(write_json(args.json, report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
