"""The achieved rate of a rate-limited tool run by several tool workers, against its limit.

    python -m benchmarks.bench_rate_limit --json benchmarks/results/rate_limit.json

A throwaway redis-server, the simulator, one inference worker and ``--tool-workers`` tool
workers run ``--calls`` agents that each call ``tests.support.rate_tools:limited_fetch``
(``@tool(rate_limit=5)``) once. Every execution records its start in Redis (Redis ``TIME``);
the achieved rate is (calls - 1) / (last start - first start). With a per-process bucket the
fleet ran at up to ``tool workers x limit``; with the Redis bucket it is held at the limit.
Only Redis keys and the public API are read, so an older checkout can be measured too
(``PYTHONPATH=/old/checkout``, with this file and ``tests/support/rate_tools.py`` copied in).
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from typing import Any

import redis

from agentbatch import submit_batch
from agentbatch.sim.config import SimConfig
from agentbatch.sim.process import SimProcess
from benchmarks.bench_recovery import Worker
from benchmarks.machine import machine_info, utc_now, write_json
from tests.support.rate_tools import RATE, limited_fetch
from tests.support.redis_server import RedisServer


def run(url: str, backend: str, tool_workers: int, calls: int) -> dict[str, Any]:
    workers = [Worker(url, "inference", "rl-inf", {})]
    workers += [Worker(url, "tools", f"rl-tool{i}", {}) for i in range(tool_workers)]
    try:
        for w in workers:
            w.start()
        tag = uuid.uuid4().hex[:8]
        task = f'Agent {{i}}.\n@sim tool limited_fetch {{{{"tag": "{tag}", "n": {{i}}}}}}'
        started = time.monotonic()
        handle = submit_batch(task, [{"i": i} for i in range(calls)], tools=[limited_fetch],
                              backend=backend, model="sim-model", redis_url=url)
        results = handle.wait(timeout=600)
        wall = time.monotonic() - started
        starts = sorted(float(s) for s in
                        redis.from_url(url).lrange(f"test:rate:{tag}", 0, -1))
    finally:
        for w in workers:
            w.stop()
    rate = (len(starts) - 1) / (starts[-1] - starts[0]) if len(starts) > 1 else None
    return {"tool_workers": tool_workers, "calls": calls, "ok": sum(r.ok for r in results),
            "executions": len(starts), "limit_per_s": RATE,
            "achieved_per_s": None if rate is None else round(rate, 3),
            "achieved_over_limit": None if rate is None else round(rate / RATE, 3),
            "wall_s": round(wall, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tool-workers", type=int, default=4)
    ap.add_argument("--calls", type=int, default=60)
    ap.add_argument("--label", default="current")
    ap.add_argument("--json", default="benchmarks/results/rate_limit.json")
    args = ap.parse_args(argv)
    report: dict[str, Any] = {"benchmark": "rate_limit", "label": args.label,
                              "created": utc_now(), "machine": machine_info(),
                              "config": vars(args)}
    server = RedisServer().start()
    try:
        with SimProcess(SimConfig(fixed_ms=5.0)) as sim:
            backend = "sim://" + sim.url.split("://", 1)[1]
            report["result"] = run(server.url, backend, args.tool_workers, args.calls)
    finally:
        server.cleanup()
    print(report["result"], flush=True)
    report["finished"] = utc_now()
    print(write_json(args.json, report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
