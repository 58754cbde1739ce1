"""Backend-level speedups on the simulator, in ONE run: batch prompting and prefix warming.

    python -m benchmarks.bench_backends --json benchmarks/results/backends.json

1. **Batch prompting.** ``--prompts`` (256) single-turn, tool-free prompts, all concurrent,
   sent (a) one ``OpenAICompatBackend.complete`` chat call per prompt and (b) through
   ``MicroBatchingBackend`` (``max_batch`` 32: one ``/v1/completions`` request per 32
   prompts). Against ``SimConfig(fixed_ms=60)`` (a flat 60 ms per *request*, whatever it
   carries -- this favours batching) and against the GPU-like mode
   (``SimConfig(max_running=64)``: every prompt is a sequence paying prefill and decode, so
   batching saves only request overhead). Recorded: HTTP requests counted by the simulator
   (``/sim/stats``), wall and client CPU seconds, and batched / per-prompt ratios.
2. **Prefix warming.** On ``SimConfig(max_running=32, prefill_ms_per_token=0.2)``, ``--agents``
   (64) concurrent *streaming* chat requests share a ~3,000-token system prompt and each add a
   short unique user message: (a) cold, (b) after one request with the shared prefix
   (``max_tokens=1``, what ``warm`` sends where a server needs it; on ``vllm://`` and
   ``sim://`` it sends none, as the simulator, like vLLM, shares a prefix in flight).
   Recorded: TTFT p50/p95 from ``ModelResponse.ttft_s``, cached/prompt token totals, the
   warm-up's own time, and warm / cold ratios.

Each simulator is a separate OS process (``SimProcess``) serving every run of its part. Before
each measurement the client opens its connections with an unrecorded round of unrelated
requests at the same concurrency, then ``POST /sim/reset`` empties the prefix cache and zeroes
the counters ("fresh sim" below), so connection set-up and process start-up hit no variant.
Variants are interleaved over ``--runs`` (3); medians are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

from benchmarks.machine import (
    RESULTS_DIR,
    Stopwatch,
    machine_info,
    median,
    ratio,
    sim_get,
    sim_reset,
    utc_now,
    write_json,
)

MODEL = "agentbatch-sim"
CLASSIFY_SYSTEM = "You are a terse ticket classifier. Answer with one word."
# ~12,000 characters (~3,000 tokens at the simulator's 4 chars/token), identical for every agent.
SHARED_SYSTEM = "You are a meticulous reviewer. Follow the house rules below.\n" + "".join(
    f"Rule {i:03d}: cite the exact line, explain the defect, propose a minimal fix, and keep "
    f"the tone neutral.\n" for i in range(125)
)
Log = Callable[[str], None]
# microbatch renders with the default ChatML template; microbatch_sim_template with the
# simulator's own chat rendering, i.e. "the model's template", as a real deployment would.
BATCH_VARIANTS = ("per_prompt", "microbatch", "microbatch_sim_template")


def sim_mode_url(url: str) -> str:
    return "sim://" + url.split("://", 1)[1]


def classify_request(i: int, tag: str = "") -> Any:
    from agentbatch.core.model_io import ModelRequest

    user = f"{tag}Classify ticket #{i}: 'The app crashes when I upload file_{i}.png'."
    return ModelRequest(model=MODEL, messages=[{"role": "system", "content": CLASSIFY_SYSTEM},
                                               {"role": "user", "content": user}],
                        request_id=f"bp-{tag}{i}")


def agent_request(i: int, system: str = SHARED_SYSTEM) -> Any:
    from agentbatch.core.model_io import ModelRequest

    return ModelRequest(model=MODEL, messages=[{"role": "system", "content": system},
                                               {"role": "user",
                                                "content": f"Agent {i}: review change #{i}."}],
                        request_id=f"ttft-{i}")


def quantile(values: list[float], q: float) -> float | None:
    """Nearest-rank quantile (no interpolation: every reported value was observed)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


async def _gather(complete: Callable[[Any], Awaitable[Any]], reqs: list[Any]) -> list[Any]:
    return await asyncio.gather(*(complete(r) for r in reqs), return_exceptions=True)


async def _reset(url: str) -> None:
    await asyncio.to_thread(sim_reset, url)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = [k for k, v in runs[0].items() if isinstance(v, int | float) and k != "run"]
    return {k: median([r.get(k) for r in runs]) for k in keys}


# -- part 1: batch prompting -----------------------------------------------------------------


async def _batch_prompting_once(url: str, variant: str, prompts: int, max_batch: int,
                                window_s: float) -> dict[str, Any]:
    from agentbatch.backends.microbatch import MicroBatchingBackend
    from agentbatch.backends.openai_compat import OpenAICompatBackend

    inner = OpenAICompatBackend(sim_mode_url(url))
    backend: Any = inner
    if variant == "microbatch":
        backend = MicroBatchingBackend(inner, window_s=window_s, max_batch=max_batch)
    elif variant == "microbatch_sim_template":
        from agentbatch.sim.tokens import render_chat

        backend = MicroBatchingBackend(inner, window_s=window_s, max_batch=max_batch,
                                       render=render_chat)
    try:
        await _gather(backend.complete, [classify_request(i, "warm-") for i in range(prompts)])
        await _reset(url)
        sent_before = inner.requests_sent
        reqs = [classify_request(i) for i in range(prompts)]
        gc.collect()
        with Stopwatch() as sw:
            results = await _gather(backend.complete, reqs)
        stats = await asyncio.to_thread(sim_get, url, "/sim/stats")
    finally:
        await backend.aclose()
    errors = sorted({f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)})
    return {
        "wall_s": sw.wall_s,
        "cpu_s": sw.cpu_s,
        "ok": sum(1 for r in results if not isinstance(r, BaseException)),
        "http_requests": int(stats["requests_total"]),
        "requests_by_endpoint": stats["requests"],
        "client_requests_sent": inner.requests_sent - sent_before,
        "prompt_tokens": stats["prompt_tokens"],
        "cached_tokens": stats["cached_tokens"],
        "uncached_prompt_tokens": stats["prompt_tokens"] - stats["cached_tokens"],
        "completion_tokens": stats["completion_tokens"],
        "max_running_seen": stats["max_running_seen"],
        "errors": errors[:5],
    }


def bench_batch_prompting(mode: str, config: Any, *, prompts: int, runs: int, max_batch: int,
                          window_s: float, log: Log) -> dict[str, Any]:
    from agentbatch.sim.process import SimProcess

    results: dict[str, dict[str, Any]] = {v: {"runs": []} for v in BATCH_VARIANTS}
    with SimProcess(config) as sim:
        for i in range(runs):
            for v in BATCH_VARIANTS:
                rec = {"run": i + 1, **asyncio.run(
                    _batch_prompting_once(sim.url, v, prompts, max_batch, window_s))}
                results[v]["runs"].append(rec)
                log(f"[{mode}] run {i + 1} {v:23s} wall={rec['wall_s']:.3f}s "
                    f"ok={rec['ok']}/{prompts} http={rec['http_requests']} "
                    f"uncached={rec['uncached_prompt_tokens']}"
                    + (f" errors={rec['errors'][:1]}" if rec["errors"] else ""))
    for res in results.values():
        res["median"] = summarize(res["runs"])
    per = results["per_prompt"]
    ratios: dict[str, Any] = {}
    for name in BATCH_VARIANTS[1:]:
        mb = results[name]
        ratios[name] = {
            "http_requests_batched_over_per_prompt": ratio(mb["median"]["http_requests"],
                                                           per["median"]["http_requests"]),
            "wall_batched_over_per_prompt": ratio(mb["median"]["wall_s"],
                                                  per["median"]["wall_s"]),
            "wall_batched_over_per_prompt_paired": [
                ratio(a["wall_s"], b["wall_s"])
                for a, b in zip(mb["runs"], per["runs"], strict=True)],
            "client_cpu_batched_over_per_prompt": ratio(mb["median"]["cpu_s"],
                                                        per["median"]["cpu_s"]),
        }
    return {"sim_config": _config_dict(config), "variants": results, "ratios": ratios}


# -- part 2: prefix warming and TTFT -----------------------------------------------------------


async def _ttft_once(url: str, variant: str, agents: int) -> dict[str, Any]:
    from agentbatch.backends.openai_compat import OpenAICompatBackend

    backend = OpenAICompatBackend(sim_mode_url(url), stream=True)
    try:
        # Open the connections with unrelated short prompts, then empty the cache.
        await _gather(backend.complete, [agent_request(i, system="warm-up") for i in
                                         range(agents)])
        await _reset(url)
        warm_s = None
        if variant == "warm":
            with Stopwatch() as wsw:
                await backend.complete(agent_request(-1).model_copy(update={"max_tokens": 1}))
            warm_s = wsw.wall_s
        gc.collect()
        with Stopwatch() as sw:
            results = await _gather(backend.complete, [agent_request(i) for i in range(agents)])
        stats = await asyncio.to_thread(sim_get, url, "/sim/stats")
    finally:
        await backend.aclose()
    ok = [r for r in results if not isinstance(r, BaseException)]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    return {
        "ok": len(ok),
        "ttft_p50_s": quantile(ttfts, 0.50),
        "ttft_p95_s": quantile(ttfts, 0.95),
        "ttft_max_s": max(ttfts) if ttfts else None,
        "ttft_count": len(ttfts),
        "fanout_wall_s": sw.wall_s,
        "warmup_s": warm_s,
        "wall_including_warmup_s": sw.wall_s + (warm_s or 0.0),
        "cached_tokens": sum(r.usage.cached_tokens for r in ok),
        "prompt_tokens": sum(r.usage.prompt_tokens for r in ok),
        "sim_cached_tokens_incl_warmup": stats["cached_tokens"],
        "sim_prompt_tokens_incl_warmup": stats["prompt_tokens"],
        "errors": sorted({f"{type(r).__name__}: {r}" for r in results
                          if isinstance(r, BaseException)})[:5],
    }


def bench_prefix_warming(config: Any, *, agents: int, runs: int, log: Log) -> dict[str, Any]:
    from agentbatch.sim.process import SimProcess

    variants = ("cold", "warm")
    results: dict[str, dict[str, Any]] = {v: {"runs": []} for v in variants}
    with SimProcess(config) as sim:
        for i in range(runs):
            for v in variants:
                rec = {"run": i + 1, **asyncio.run(_ttft_once(sim.url, v, agents))}
                results[v]["runs"].append(rec)
                log(f"[ttft] run {i + 1} {v:4s} p50={rec['ttft_p50_s'] or 0:.3f}s "
                    f"p95={rec['ttft_p95_s'] or 0:.3f}s cached={rec['cached_tokens']}"
                    f"/{rec['prompt_tokens']} ok={rec['ok']}/{agents}"
                    + (f" errors={rec['errors'][:1]}" if rec["errors"] else ""))
    for res in results.values():
        res["median"] = summarize(res["runs"])
    cold, warm = results["cold"]["median"], results["warm"]["median"]
    return {
        "agents": agents,
        "shared_system_prompt_chars": len(SHARED_SYSTEM),
        "shared_system_prompt_tokens_approx": math.ceil(len(SHARED_SYSTEM) / 4),
        "sim_config": _config_dict(config),
        "variants": results,
        "ratios": {
            "ttft_p50_warm_over_cold": ratio(warm["ttft_p50_s"], cold["ttft_p50_s"]),
            "ttft_p95_warm_over_cold": ratio(warm["ttft_p95_s"], cold["ttft_p95_s"]),
            "wall_including_warmup_warm_over_cold": ratio(warm["wall_including_warmup_s"],
                                                          cold["fanout_wall_s"]),
        },
    }


def _config_dict(config: Any) -> dict[str, Any]:
    keep = ("fixed_ms", "max_running", "prefill_ms_per_token", "decode_ms", "decode_batch_slope",
            "tokens_per_step", "cache_blocks")
    return {k: v for k, v in asdict(config).items() if k in keep}


# -- the run ---------------------------------------------------------------------------------


def run_benchmark(*, prompts: int, agents: int, runs: int, max_batch: int, window_s: float,
                  log: Log = print) -> dict[str, Any]:
    from agentbatch.sim.config import SimConfig

    info = machine_info()
    started = time.perf_counter()
    batching = {
        "fixed_ms_60": bench_batch_prompting(
            "fixed_ms_60", SimConfig(fixed_ms=60), prompts=prompts, runs=runs,
            max_batch=max_batch, window_s=window_s, log=log),
        "gpu_like_max_running_64": bench_batch_prompting(
            "gpu_like", SimConfig(max_running=64), prompts=prompts, runs=runs,
            max_batch=max_batch, window_s=window_s, log=log),
    }
    warming = bench_prefix_warming(SimConfig(max_running=32, prefill_ms_per_token=0.2),
                                   agents=agents, runs=runs, log=log)
    info["loadavg_at_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    return {
        "benchmark": "backends",
        "created": utc_now(),
        "runs": runs,
        "machine": info,
        "batch_prompting": {
            "prompts": prompts,
            "concurrency": prompts,
            "max_batch": max_batch,
            "window_s": window_s,
            "modes": batching,
            "notes": [
                "per_prompt: one chat completion per prompt, all concurrent; microbatch: "
                "MicroBatchingBackend over the same OpenAICompatBackend, so the prompts leave "
                f"as ceil({prompts}/{max_batch}) /v1/completions requests with a prompt list.",
                "fixed_ms_60: the simulator charges one flat 60 ms forward pass per HTTP "
                "request, however many prompts it carries. That favours batching: it models "
                "request overhead, not per-prompt compute.",
                "gpu_like_max_running_64: each prompt is its own sequence paying prefill and "
                "decode in a 64-wide continuous batch, so batching can only save request "
                "overhead (HTTP, parsing, scheduling) -- closer to what a vLLM server does.",
                "microbatch renders each conversation with the default ChatML template, "
                "which is ~40% more tokens than the simulator's compact chat rendering "
                "('<|role|>content'), and in the GPU-like mode those extra uncached tokens "
                "cost prefill (see uncached_prompt_tokens). microbatch_sim_template renders "
                "with the simulator's own chat rendering (agentbatch.sim.tokens.render_chat), "
                "the analogue of passing render= the served model's real chat template: same "
                "tokens as the chat endpoint, so only the request count differs.",
                "http_requests: counted by the simulator (/sim/stats requests_total) for the "
                "recorded round only (connections were opened by an unrecorded round first).",
            ],
        },
        "prefix_warming": {
            **warming,
            "notes": [
                "A simulator model of prefill cost (prefill_ms_per_token x uncached prompt "
                "tokens, a 16-token-block LRU prefix cache), not a GPU: the ratios show what "
                "warming saves under that model, not what a given GPU server will show.",
                "In this simulator, sequences admitted in the same engine step reuse the "
                "prefix blocks the first of them fills, so a cold start pays the shared "
                "prefix's prefill about once (in the first step) rather than once per "
                "request; real servers may pay more when concurrent requests miss together.",
                "TTFT is measured by the client (ModelResponse.ttft_s: request sent -> first "
                "content delta) on a streaming OpenAICompatBackend; it excludes the warm-up "
                "request, whose own time is warmup_s (wall_including_warmup_s adds it).",
                "cached_tokens / prompt_tokens: sums over the fan-out responses' usage; "
                "sim_*_incl_warmup: the simulator's totals since the reset, warm-up included.",
                "fresh sim = POST /sim/reset (prefix cache emptied, counters zeroed, nothing "
                "in flight) after an unrecorded round of unrelated prompts opened the "
                "connections.",
            ],
        },
        "total_benchmark_s": time.perf_counter() - started,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_backends",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--agents", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--window-s", type=float, default=0.01)
    p.add_argument("--json", default=str(RESULTS_DIR / "backends.json"))
    args = p.parse_args(argv)
    data = run_benchmark(prompts=args.prompts, agents=args.agents, runs=args.runs,
                         max_batch=args.max_batch, window_s=args.window_s,
                         log=lambda m: print(m, file=sys.stderr))
    out = write_json(args.json, data)
    from benchmarks.report import render_file

    print(render_file(data))
    print(f"\nwrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
