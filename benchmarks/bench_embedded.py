"""agentbatch embedded vs the naive gather loop vs batch-agent, in ONE run, on ONE simulator.

    python -m benchmarks.bench_embedded --agents 200 \\
        --json benchmarks/results/embedded_tool_roundtrip.json
    python -m benchmarks.bench_embedded --workload tool_roundtrip_shared \\
        --json benchmarks/results/embedded_tool_roundtrip_shared.json

One ``SimProcess(SimConfig(fixed_ms=...))`` (a separate OS process, so its CPU is not ours)
serves every run. Runs are interleaved, each round starting one system later (A B C, B C A,
C A B, ...), so slow phases of a noisy machine, and whatever the first place in a round
costs, hit every system alike; simulator counters are reset (``POST /sim/reset``) before each run.
Each system first does one small unrecorded warm-up batch. Per run we record wall seconds,
ok count, agents/s, model requests seen by the simulator, real tool executions, and the CPU
seconds of this (client) process, divided by the model requests: CPU ms per agent turn.
Only ratios and bounds measured in the same run are meant to be compared across machines.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from benchmarks import agentbatch_runner
from benchmarks.machine import (
    RESULTS_DIR,
    Stopwatch,
    machine_info,
    median,
    ratio,
    rotated,
    sim_get,
    sim_reset,
    utc_now,
    write_json,
)
from benchmarks.peers import RunOutcome, batch_agent_peer, naive_gather
from benchmarks.workloads import ToolCounter, Workload, get_workload

Runner = Callable[[str, Workload, int, ToolCounter], Awaitable[RunOutcome]]


@dataclass
class System:
    name: str
    label: str
    run: Runner
    settings: dict[str, Any] = field(default_factory=dict)


def systems(agents: int) -> dict[str, System]:
    """Every system this benchmark knows; ``DEFAULT_SYSTEMS`` are run unless told otherwise."""
    return {
        "agentbatch": System(agentbatch_runner.NAME, agentbatch_runner.LABEL,
                             agentbatch_runner.run, agentbatch_runner.settings(agents)),
        "naive_gather": System(naive_gather.NAME, naive_gather.LABEL, naive_gather.run,
                               dict(naive_gather.SETTINGS)),
        "batch_agent": System(batch_agent_peer.NAME, batch_agent_peer.LABEL,
                              batch_agent_peer.run, batch_agent_peer.settings(agents)),
        # Variant: agentbatch without its prefix warm-up request. The simulator's latency is
        # fixed per request (no prefill cost to save), so the warm-up's forward pass only
        # adds to the critical path here; this variant is the client's own overhead.
        "agentbatch_no_warmup": System(
            "agentbatch_no_warmup", "agentbatch embedded, warm_prefix=False",
            partial(agentbatch_runner.run, warm_prefix=False),
            agentbatch_runner.settings(agents, warm_prefix=False)),
        # Variant: batch-agent without its KVFlow advisor (prefetch POSTs that 404 here).
        "batch_agent_nokvflow": System(
            "batch_agent_nokvflow", "batch-agent 0.2.0, kvflow=False",
            partial(batch_agent_peer.run, kvflow=False),
            batch_agent_peer.settings(agents, kvflow=False)),
    }


DEFAULT_SYSTEMS = ("agentbatch", "naive_gather", "batch_agent", "batch_agent_nokvflow")
NUMERIC_FIELDS = ("wall_s", "ok", "agents_per_s", "model_requests", "tool_executions",
                  "tool_calls", "tool_calls_shared", "cpu_s", "cpu_ms_per_turn",
                  "wall_over_critical_path")


async def _timed(system: System, url: str, workload: Workload, agents: int,
                 counter: ToolCounter, timeout_s: float) -> tuple[RunOutcome | None, str | None,
                                                                  Stopwatch]:
    gc.collect()
    with Stopwatch() as sw:
        try:
            outcome = await asyncio.wait_for(system.run(url, workload, agents, counter),
                                             timeout_s)
            error = None
        except Exception as exc:  # a crashing system is a result, not a crashed benchmark
            outcome, error = None, f"{type(exc).__name__}: {exc}"
    return outcome, error, sw


def measure(system: System, url: str, workload: Workload, agents: int,
            timeout_s: float) -> dict[str, Any]:
    """One recorded batch of ``system``: reset the sim, run, read its counters."""
    counter = ToolCounter()
    sim_reset(url)
    outcome, error, sw = asyncio.run(_timed(system, url, workload, agents, counter, timeout_s))
    stats = sim_get(url, "/sim/stats")
    model_requests = int(stats["requests"].get("chat_completions", 0))
    ok = outcome.ok if outcome else 0
    return {
        "wall_s": sw.wall_s,
        "ok": ok,
        "agents": agents,
        "agents_per_s": ok / sw.wall_s if sw.wall_s else None,
        "model_requests": model_requests,
        "model_turns_expected": workload.expected_model_turns(agents),
        "tool_executions": counter.executions,
        "tool_executions_needed": workload.expected_tool_executions(agents),
        "tool_calls": outcome.tool_calls if outcome else None,
        "tool_calls_shared": outcome.tool_calls_shared if outcome else None,
        "cpu_s": sw.cpu_s,
        "cpu_ms_per_turn": 1e3 * sw.cpu_s / model_requests if model_requests else None,
        "wall_over_critical_path": sw.wall_s / workload.critical_path_s,
        "sim": {k: stats.get(k) for k in ("prompt_tokens", "cached_tokens", "completion_tokens",
                                          "max_running_seen", "bad_requests", "faults_total")},
        "errors": ([error] if error else []) + (outcome.errors if outcome else []),
        "extra": outcome.extra if outcome else {},
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {f: median([r.get(f) for r in runs]) for f in NUMERIC_FIELDS}


def compute_ratios(results: dict[str, dict[str, Any]], critical_path_s: float) -> dict[str, Any]:
    """Bounds and head-to-head ratios, from medians and from paired (same-round) runs."""
    out: dict[str, Any] = {}
    for name, res in results.items():
        out[f"{name}_wall_over_critical_path"] = ratio(res["median"]["wall_s"], critical_path_s)
    base = results.get("agentbatch")
    if base is None:
        return out
    for name, res in results.items():
        if name == "agentbatch":
            continue
        out[f"agentbatch_wall_over_{name}_wall"] = ratio(base["median"]["wall_s"],
                                                         res["median"]["wall_s"])
        out[f"{name}_wall_over_agentbatch_wall"] = ratio(res["median"]["wall_s"],
                                                         base["median"]["wall_s"])
        out[f"agentbatch_cpu_per_turn_over_{name}"] = ratio(
            base["median"]["cpu_ms_per_turn"], res["median"]["cpu_ms_per_turn"])
        paired = [ratio(a["wall_s"], b["wall_s"]) for a, b in zip(base["runs"], res["runs"],
                                                                   strict=False)]
        out[f"agentbatch_wall_over_{name}_wall_paired"] = paired
    return out


def run_benchmark(workload: Workload, agents: int, runs: int, names: list[str],
                  warmup: bool = True, timeout_s: float = 600.0,
                  log: Callable[[str], None] = print, gpu_like: bool = False) -> dict[str, Any]:
    """``gpu_like``: the simulator's GPU-like mode (prefill priced per uncached prompt token,
    decode per step, a running batch of at most 64) instead of the workload's fixed cost per
    forward pass, so what a cached prefix saves shows in the wall."""
    from agentbatch.sim.config import SimConfig
    from agentbatch.sim.process import SimProcess

    known = systems(agents)
    chosen = [known[n] for n in names]
    info = machine_info()
    results: dict[str, dict[str, Any]] = {
        s.name: {"label": s.label, "settings": s.settings, "runs": []} for s in chosen
    }
    started = time.perf_counter()
    config = SimConfig() if gpu_like else SimConfig(fixed_ms=workload.fixed_ms)
    with SimProcess(config) as sim:
        if warmup:
            for s in chosen:
                w = measure(s, sim.url, workload, min(20, agents), timeout_s)
                log(f"warm-up {s.name}: ok={w['ok']}/{w['agents']} wall={w['wall_s']:.2f}s")
        for i in range(runs):
            # each round starts one system later (A B C, B C A, C A B, ...): with the same
            # code, agentbatch measured 1.13x warm_prefix=False when it ran first in every
            # round and 1.01x when it ran second, so a fixed order biases the ratios
            for s in rotated(chosen, i):
                rec = {"run": i + 1, **measure(s, sim.url, workload, agents, timeout_s)}
                results[s.name]["runs"].append(rec)
                log(f"run {i + 1} {s.name:22s} wall={rec['wall_s']:.3f}s ok={rec['ok']}/{agents}"
                    f" reqs={rec['model_requests']} tools={rec['tool_executions']}"
                    f" cpu={rec['cpu_ms_per_turn'] or 0:.2f}ms/turn"
                    + (f" errors={rec['errors'][:1]}" if rec["errors"] else ""))
    for res in results.values():
        res["median"] = summarize(res["runs"])
    info["loadavg_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return {
        "benchmark": "embedded",
        "created": utc_now(),
        "workload": workload.describe(),
        "agents": agents,
        "runs": runs,
        "critical_path_s": workload.critical_path_s,
        "sim": {"fixed_ms": config.fixed_ms,
                "mode": (f"gpu_like (prefill {config.prefill_ms_per_token} ms per uncached "
                         f"prompt token, decode {config.decode_ms} ms per step, at most "
                         f"{config.max_running} running)" if gpu_like
                         else "fixed_ms (unlimited concurrency)"),
                "process": "separate OS process (agentbatch.sim.process.SimProcess)"},
        "warmup": warmup,
        "machine": info,
        "systems": results,
        "ratios": compute_ratios(results, workload.critical_path_s),
        "total_benchmark_s": time.perf_counter() - started,
        "notes": [
            "cpu_ms_per_turn = client-process CPU (time.process_time delta, all threads) / "
            "chat requests counted by the simulator (including warm-up/probe requests).",
            "tool_executions counts real executions of the tool body; tool_calls what the "
            "agents asked for; tool_calls_shared those served by cache or coalescing "
            "(None: the system does not report it).",
            "batch_agent model_requests include its 5 warm-up/prefix-probe requests.",
        ],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_embedded",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="tool_roundtrip")
    p.add_argument("--agents", type=int, default=None, help="default: the workload's N")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help=f"comma list of: {', '.join(systems(1))}")
    p.add_argument("--json", default=None,
                   help="output path (default: benchmarks/results/embedded_<workload>.json)")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--gpu-like", action="store_true",
                   help="the simulator prices prefill per uncached token (not fixed_ms)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per batch")
    args = p.parse_args(argv)

    workload = get_workload(args.workload)
    agents = args.agents or workload.agents
    names = [n.strip() for n in args.systems.split(",") if n.strip()]
    unknown = [n for n in names if n not in systems(agents)]
    if unknown:
        p.error(f"unknown systems: {unknown}")
    data = run_benchmark(workload, agents, args.runs, names, warmup=not args.no_warmup,
                         timeout_s=args.timeout, log=lambda m: print(m, file=sys.stderr),
                         gpu_like=args.gpu_like)
    out = write_json(args.json or RESULTS_DIR / f"embedded_{workload.name}.json", data)
    from benchmarks.report import render_file

    print(render_file(data))
    print(f"\nwrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
