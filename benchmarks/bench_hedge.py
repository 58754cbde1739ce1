"""What ``hedge_after=`` buys with one slow endpoint in a pool of three, and what it costs.

    python -m benchmarks.bench_hedge --json benchmarks/results/hedge.json

Three simulator processes (``--fixed-ms``: every request takes that long, no queue): two at
``--fast-ms``, one at ``--slow-ms`` (a sick GPU, a throttled node). The same embedded batch
(``--agents`` agents of three model turns, two tool calls each) runs on the pool without
hedging and with ``hedge_after``, alternately, ``--repeats`` times, the simulators' counters
reset before each run. Per run: wall time, agent latency (``AgentResult.latency_s``: p50,
p99, max), the pool's hedge counters, and the tokens each simulator took (prompt tokens are
counted when a request starts, so a cancelled loser's prompt is in them; completion tokens
only when it finishes). The ratios (hedged / unhedged) are of medians over the repeats, all
measured in this run.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from typing import Any

from agentbatch import submit_batch
from agentbatch.sim.config import SimConfig
from agentbatch.sim.process import SimProcess
from benchmarks.machine import machine_info, median, ratio, sim_get, sim_reset, utc_now, write_json
from tests.support.pure_tools import stamp

TURNS = 3
TASK = ('Agent {i}.\n@sim tool stamp {{"key": "a{i}"}}\n'
        '@sim tool stamp {{"key": "b{i}"}}')  # three model turns, two tool calls


def quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile of a non-empty list."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def one_run(sims: list[SimProcess], agents: int, hedge_after: float | None) -> dict[str, Any]:
    for sim in sims:
        sim_reset(sim.url)
    t0 = time.monotonic()
    handle = submit_batch(TASK, [{"i": i} for i in range(agents)], model="sim-model",
                          tools=[stamp], backend=[s.url for s in sims],
                          hedge_after=hedge_after, timeout_per_turn=120)
    results = handle.wait(timeout=900)
    wall = time.monotonic() - t0
    pool = handle.stats()["pool"]
    handle.close()
    deadline = time.monotonic() + 60  # the slow server ends (or drops) what it still holds
    while time.monotonic() < deadline and any(sim_get(s.url, "/sim/stats")["running"]
                                              for s in sims):
        time.sleep(0.05)
    servers = []
    for sim in sims:
        st = sim_get(sim.url, "/sim/stats")
        chat = int(st["requests"].get("chat_completions", 0))
        servers.append({"url": sim.url, "fixed_ms": sim.config.fixed_ms, "chat_requests": chat,
                        "answered": int(st["success"]), "unanswered": chat - int(st["success"]),
                        "prompt_tokens": st["prompt_tokens"],
                        "cached_tokens": st["cached_tokens"],
                        "completion_tokens": st["completion_tokens"]})
    latency = [r.latency_s for r in results if r.latency_s is not None]
    ok = sum(r.ok for r in results)
    return {
        "hedge_after": hedge_after,
        "agents": agents,
        "ok": ok,
        "turns": sum(r.turns for r in results),
        "wall_s": round(wall, 3),
        "agent_latency_p50_s": round(quantile(latency, 0.50), 3),
        "agent_latency_p99_s": round(quantile(latency, 0.99), 3),
        "agent_latency_max_s": round(max(latency), 3),
        "hedge": pool["hedge"],
        "moves": pool["moves"],
        "servers": servers,
        "server_prompt_tokens": sum(s["prompt_tokens"] for s in servers),
        "server_completion_tokens": sum(s["completion_tokens"] for s in servers),
        "server_tokens": sum(s["prompt_tokens"] + s["completion_tokens"] for s in servers),
        "chat_requests": sum(s["chat_requests"] for s in servers),
    }


def rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("wall_s", "agent_latency_p50_s", "agent_latency_p99_s", "agent_latency_max_s",
            "server_tokens", "server_prompt_tokens", "server_completion_tokens",
            "chat_requests", "turns")
    return {k: median([r[k] for r in runs]) for k in keys}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_hedge")
    p.add_argument("--agents", type=int, default=60)
    p.add_argument("--fast-ms", type=float, default=300.0)
    p.add_argument("--slow-ms", type=float, default=3000.0)
    p.add_argument("--hedge-after", type=float, default=2.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    started = utc_now()
    sims = [SimProcess(SimConfig(fixed_ms=args.fast_ms)) for _ in range(2)]
    sims.append(SimProcess(SimConfig(fixed_ms=args.slow_ms)))
    runs: dict[str, list[dict[str, Any]]] = {"unhedged": [], "hedged": []}
    try:
        for sim in sims:
            sim.start()
        for _ in range(args.repeats):  # alternated, so drift on a shared box hits both
            runs["unhedged"].append(one_run(sims, args.agents, None))
            runs["hedged"].append(one_run(sims, args.agents, args.hedge_after))
    finally:
        for sim in sims:
            sim.stop()
    base, hedged = summary(runs["unhedged"]), summary(runs["hedged"])
    ratios = {k: rounded(ratio(hedged[k], base[k]))
              for k in ("wall_s", "agent_latency_p99_s", "agent_latency_p50_s",
                        "server_tokens", "chat_requests")}
    extra_tokens = (hedged["server_tokens"] or 0) - (base["server_tokens"] or 0)
    data = {
        "benchmark": "hedge", "created": utc_now(), "started": started,
        "command": "python -m benchmarks.bench_hedge " + " ".join(argv or []),
        "machine": machine_info(),
        "settings": {"agents": args.agents, "turns_per_agent": TURNS,
                     "fast_ms": args.fast_ms, "slow_ms": args.slow_ms,
                     "pool": "2 x fast + 1 x slow simulator (fixed latency, no queue)",
                     "hedge_after": args.hedge_after, "repeats": args.repeats,
                     "task": TASK, "pid": os.getpid()},
        "unhedged": base,
        "hedged": hedged,
        "ratios_hedged_over_unhedged": ratios,
        "extra_server_tokens": extra_tokens,
        "runs": runs,
    }
    print(f"unhedged: p99 {base['agent_latency_p99_s']} s, wall {base['wall_s']} s, "
          f"tokens {base['server_tokens']}")
    print(f"hedged:   p99 {hedged['agent_latency_p99_s']} s, wall {hedged['wall_s']} s, "
          f"tokens {hedged['server_tokens']} (+{extra_tokens})")
    print(f"ratios hedged/unhedged: {ratios}")
    if args.json:
        write_json(args.json, data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
