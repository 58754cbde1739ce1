"""The recovery sweep's cost per pass against the number of active batches.

N batches of 2 agents are submitted to a real redis-server (no workers: every agent stays
active), then one in-process ``WorkerContext`` runs sweep passes. Per pass: Redis commands
(``INFO commandstats``, Lua included) and wall time, with no agent due and with D agents
due. Each checkout runs in its own process (``--code before=/tmp/before --code after=.``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
PASSES = 12


def _commands(client: Any) -> int:
    return sum(v["calls"] for v in client.info("commandstats").values())


def run_one(spec: str) -> dict[str, Any]:
    """``BATCHES:DUE``: submit, then time sweep passes on the ``agentbatch`` on sys.path.
    The DUE agents are still queued (no worker runs), so each pass looks at them and moves
    their deadline; they are made due again before the next pass."""
    batches, due = (int(x) for x in spec.split(":"))
    os.environ["AGENTBATCH_QUEUE_GRACE_S"] = "3600"  # nothing due unless made so below
    import redis

    from agentbatch import submit_batch
    from agentbatch.distributed.state.keys import BatchKeys
    from agentbatch.distributed.workers import sweep
    from agentbatch.distributed.workers.context import WorkerContext
    from agentbatch.distributed.workers.settings import WorkerSettings
    from agentbatch.sim.config import SimConfig
    from agentbatch.sim.process import SimProcess
    from tests.support.redis_server import RedisServer

    server = RedisServer().start()
    sim = SimProcess(SimConfig(fixed_ms=5)).start()
    try:
        os.environ["AGENTBATCH_REDIS_URL"] = server.url
        backend = "sim://" + sim.url.split("://", 1)[1]
        ids = [submit_batch("hello {i}", [{"i": 0}, {"i": 1}], model="sim-model",
                            backend=backend, redis_url=server.url).batch_id
               for _ in range(batches)]
        r = redis.from_url(server.url, decode_responses=True)
        def make_due() -> None:  # agent 0 of the first DUE batches: due now, every pass
            for batch_id in ids[:due]:
                k = BatchKeys(batch_id)
                member = k.member(0) if hasattr(k, "member") else "0"
                r.zadd(k.watch, {member: 0})

        ctx = WorkerContext(WorkerSettings.from_env())

        async def passes() -> list[tuple[int, float]]:
            out = []
            for _ in range(PASSES):
                make_due()
                before = _commands(r)
                started = time.perf_counter()
                await sweep.sweep_once(ctx)
                wall = time.perf_counter() - started
                out.append((_commands(r) - before - 1, wall))  # -1: our INFO
            return out

        measured = asyncio.run(passes())[2:]  # the first passes load and warm
    finally:
        sim.stop()
        server.cleanup()
    return {"active_batches": batches, "agents_due": due,
            "commands_per_pass": statistics.median(c for c, _ in measured),
            "ms_per_pass": round(statistics.median(w for _, w in measured) * 1000, 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--specs", default="50:0,500:0,500:10",
                   help="BATCHES:DUE pairs, comma-separated")
    p.add_argument("--code", action="append", default=[],
                   help="LABEL=PATH of a checkout to measure (repeat); default: after=.")
    p.add_argument("--json", default="benchmarks/results/sweep.json")
    p.add_argument("--inner", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.inner is not None:
        print(json.dumps(run_one(args.inner)))
        return 0
    sys.path.insert(0, str(HERE.parents[1]))
    from benchmarks.code_versions import parse_codes, run_inner
    from benchmarks.machine import machine_info, utc_now, write_json

    rows = []
    for spec in args.specs.split(","):
        for label, path in parse_codes(args.code):
            row = run_inner(HERE, label, path, spec)
            print(row, flush=True)
            rows.append(row)
    report = {"benchmark": "sweep", "when": utc_now(), "machine": machine_info(),
              "workload": {"agents_per_batch": 2, "passes_measured": PASSES - 2,
                           "statistic": "median per pass"},
              "rows": rows}
    write_json(Path(args.json), report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
