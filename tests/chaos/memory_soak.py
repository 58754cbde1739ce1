"""Memory over a long run: RSS of every worker before and after consecutive batches.

    python -m tests.chaos.memory_soak --batches 5 --agents 1000 \\
        --json benchmarks/results/memory_soak.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from agentbatch import submit_batch
from agentbatch.sim.config import SimConfig
from agentbatch.sim.process import SimProcess
from tests.chaos.client import TASK, inputs
from tests.support.redis_server import RedisServer
from tests.support.tools import Answer, cached_lookup, lookup
from tests.support.workers import WorkerProcess


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=5)
    p.add_argument("--agents", type=int, default=1000)
    p.add_argument("--json", default="benchmarks/results/memory_soak.json")
    args = p.parse_args(argv)
    server = RedisServer().start()
    sim = SimProcess(SimConfig(fixed_ms=20)).start()
    backend = "sim://" + sim.url.split("://", 1)[1]
    env = {"TEST_TOOL_SLEEP_S": "0.05"}
    fleet = [WorkerProcess(server.url, queues=q, concurrency=16, name=f"m{i}", env=env)
             for i, q in enumerate(["inference"] * 4 + ["tools"] * 2)]
    rows = []
    try:
        for w in fleet:
            w.start(wait=False)
        for w in fleet:
            w.wait_ready()
        for b in range(args.batches):
            before = [rss_mib(w.proc.pid) for w in fleet]
            started = time.perf_counter()
            results = submit_batch(TASK, inputs(args.agents), tools=[lookup, cached_lookup],
                                   output_schema=Answer, model="sim-model", backend=backend,
                                   redis_url=server.url, max_turns=5).wait(timeout=1800)
            rows.append({"batch": b + 1, "wall_s": round(time.perf_counter() - started, 2),
                         "ok": sum(r.ok for r in results), "rss_mib_before": before,
                         "rss_mib_after": [rss_mib(w.proc.pid) for w in fleet]})
            print(rows[-1], flush=True)
    finally:
        for w in fleet:
            w.stop(timeout=30)
        sim.stop()
        server.cleanup()
    first, last = rows[0]["rss_mib_after"], rows[-1]["rss_mib_after"]
    growth = [round(b - a, 1) for a, b in zip(first, last, strict=True)]
    report = {"benchmark": "memory_soak", "agents_per_batch": args.agents,
              "batches": rows, "rss_growth_mib_first_to_last_batch": growth,
              "max_growth_mib": max(growth)}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"max_growth_mib": report["max_growth_mib"], "growth": growth}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
