"""What one token costs llama-server on this machine: read as prompt, or decoded.

Why: where ``bench_engine``'s time goes (its tools workload (b) has a 0.7x-naive target).
This measures, on the same server settings (``LlamaServer``: 4 slots, half the CPUs as
threads), the seconds per token of

* **prompt**: 4 requests at once, each a shared cached prefix (~300 tokens, as the workloads'
  system prompts) plus ~35 new tokens (as a turn's new messages), ``max_tokens`` 1;
* **decode**: 1 and 4 requests at once, each decoding 64 tokens (``ignore_eos``).

Token counts come from the engine's own ``/metrics`` deltas, wall time from the client. Then
it reads ``benchmarks/results/engine.json`` and, for each system on each workload, predicts
the wall from its measured prompt and generated tokens at these costs, beside the wall it
measured, and what its prompt tokens alone would cost (``ratio_floor_prompt_only``: the
ratio to naive if generating were free).
Not part of the pytest suite.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from agentbatch.engine import LlamaServer
from benchmarks.machine import machine_info, utc_now, write_json

# bench_engine (scrape, ITEMS) is imported where used: it needs openai, a dev extra, and the
# report's test imports ``predict`` from here with the test extras only.

PREFIX = ("You label short product reviews for a shop. Read the review, decide whether the "
          "customer was happy, and give a very short reason in plain words. " * 11)
NEW_TEXT = "Ticket {n}: the {n}th customer wrote a review about a kettle that arrived late, " \
           "was scratched on one side, but boiled water quickly and quietly every morning."


async def _complete(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> None:
    body: dict[str, Any] = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0.0, "ignore_eos": True, "cache_prompt": True}
    resp = await client.post(f"{url}/v1/completions", json=body)
    resp.raise_for_status()


async def _round(client: httpx.AsyncClient, url: str, prompts: list[str], max_tokens: int
                 ) -> dict[str, float]:
    from benchmarks.bench_engine import scrape

    before = scrape(url)
    t0 = time.perf_counter()
    await asyncio.gather(*(_complete(client, url, p, max_tokens) for p in prompts))
    wall = time.perf_counter() - t0
    after = scrape(url)
    return {"wall_s": wall, **{k: after[k] - before[k] for k in after}}


async def measure(url: str, rounds: int) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=300) as client:
        # Every slot holds the shared prefix before timing (4 at once: one per slot).
        await asyncio.gather(*(_complete(client, url, PREFIX + f"warm {i}", 1) for i in range(4)))
        n = 0
        prompt_rows, decode_rows = [], {1: [], 4: []}
        for _ in range(rounds):
            prompts = []
            for _ in range(4):
                n += 1
                prompts.append(PREFIX + NEW_TEXT.format(n=n))
            prompt_rows.append(await _round(client, url, prompts, 1))
            for c in (1, 4):
                short = []
                for _ in range(c):
                    n += 1
                    short.append(f"Count slowly, item {n}:")
                decode_rows[c].append(await _round(client, url, short, 64))

    def per_token(rows: list[dict[str, float]], counter: str) -> float:
        return statistics.median(r["wall_s"] / r[counter] for r in rows if r[counter] > 0)

    return {
        "prompt": {"rows": prompt_rows,
                   "s_per_token": per_token(prompt_rows, "prompt_tokens_total")},
        "decode_1": {"rows": decode_rows[1],
                     "s_per_token": per_token(decode_rows[1], "tokens_predicted_total")},
        "decode_4": {"rows": decode_rows[4],
                     "s_per_token": per_token(decode_rows[4], "tokens_predicted_total")},
    }


def predict(costs: dict[str, Any], engine: dict[str, Any]) -> dict[str, Any]:
    """Each system's wall on each workload at these costs, beside the measured one."""
    p, d = costs["prompt"]["s_per_token"], costs["decode_4"]["s_per_token"]
    out: dict[str, Any] = {}
    for workload, systems in engine["summary"].items():
        naive = systems.get("naive", {}).get("wall_s_median")
        rows = {}
        for system, s in systems.items():
            prompt, gen = s.get("engine_prompt_tokens_median"), s.get(
                "engine_generated_tokens_median")
            if not prompt or not gen or system == "batch_agent":
                continue
            rows[system] = {
                "measured_wall_s": s["wall_s_median"],
                "predicted_wall_s": round(prompt * p + gen * d, 1),
                "prompt_tokens": prompt, "generated_tokens": gen,
            }
            if naive and system != "naive":
                rows[system]["ratio_to_naive"] = round(s["wall_s_median"] / naive, 3)
                rows[system]["ratio_floor_prompt_only"] = round(prompt * p / naive, 3)
        out[workload] = rows
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--engine-json", default="benchmarks/results/engine.json")
    ap.add_argument("--json", default="benchmarks/results/engine_costs.json")
    args = ap.parse_args(argv)
    with LlamaServer(parallel=4) as server:
        costs = asyncio.run(measure(server.http_url, args.rounds))
        command = server.command()
    engine = json.loads(Path(args.engine_json).read_text())
    report = {
        "benchmark": "engine_costs",
        "created": utc_now(),
        "machine": machine_info(),
        "command": "python -m benchmarks.bench_engine_costs " + " ".join(
            sys.argv[1:] if argv is None else argv),
        "engine": {"server_command": command},
        "costs": costs,
        "engine_json": {"path": args.engine_json, "commit": engine["machine"]["git"]["commit"]},
        "predicted": predict(costs, engine),
    }
    write_json(Path(args.json), report)
    print(json.dumps({k: v.get("s_per_token", v) for k, v in costs.items()}, indent=1))
    print(json.dumps(report["predicted"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
