"""What carrying a moved agent's conversation saves (issue 26 item 2: llama.cpp's slot save
and restore for an agent that must move).

    python -m benchmarks.bench_slot_carry --json benchmarks/results/slot_carry.json

Two llama-servers (``-t 1``, each pinned to its own CPU, 2 slots) sharing one
``--slot-save-path``, as one ``EndpointPool``. Per trial, a new agent's first turn runs on
one server with a conversation of ``pages`` pages; its second turn is moved off that server
for load (its in-flight count set past the bound, so the move does not wait on timing). In
``carried`` trials the pool saves the conversation there and restores it on the other
server before the turn goes (``EndpointPool._carry``); in ``cold`` trials the pair is marked
as sharing nothing, so the turn computes its conversation on the other server, which is what
every move did before. The trials alternate (carried, cold, carried, ...). Per trial: the
moved turn's wall from ``pool.complete`` to its reply (the carry included), and the prompt
tokens the server computed for it (its reply's usage). Ratios: carried over cold, medians.
Not part of the pytest suite (tests/engine/test_engine_pool_carry.py is).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from typing import Any

from agentbatch.backends.llamacpp import LlamaCppBackend
from agentbatch.backends.pool import EndpointPool
from agentbatch.core.model_io import ModelRequest
from agentbatch.engine import LlamaServer
from benchmarks.machine import machine_info, median, ratio, utc_now, write_json

MODEL = "smollm2"
SYSTEM = "You read a manual page by page and answer questions about it."
PAGE = ("Section {p}.{n}: the pump must be primed before first use; check the seal, the "
        "valve and the filter, and write the reading in the log book with the date. ")


def conversation(case: str, pages: int, turn: int) -> list[dict[str, Any]]:
    """A case's conversation: ``pages`` pages read (fixed assistant replies); turn 2 adds a
    question."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": f"Case {case}."}]
    for p in range(1, pages + 1):
        messages += [{"role": "assistant", "content": f"Read page {p}."},
                     {"role": "user", "content": "".join(PAGE.format(p=p, n=n)
                                                         for n in range(8))}]
    if turn == 2:
        messages += [{"role": "assistant", "content": "Done."},
                     {"role": "user", "content": "Which part must be checked first?"}]
    return messages


async def trial(pool: EndpointPool, case: str, pages: int, carry: bool) -> dict[str, Any]:
    first = await pool.complete(ModelRequest(model=MODEL, max_tokens=1, temperature=0.0,
                                             agent_key=case,
                                             messages=conversation(case, pages, 1)))
    home = pool._names.index(first.endpoint or "")
    other = 1 - home
    pair = (pool._names[home], pool._names[other])
    if carry:
        pool._no_carry.discard(pair)
    else:
        pool._no_carry.add(pair)
    pool._eps[home].outstanding = 5  # past the load bound (the floor, 2): the turn moves
    started = time.perf_counter()
    try:
        moved = await pool.complete(ModelRequest(
            model=MODEL, max_tokens=1, temperature=0.0, agent_key=case,
            cached_on=first.endpoint, messages=conversation(case, pages, 2)))
    finally:
        pool._eps[home].outstanding = 0
    wall = time.perf_counter() - started
    assert moved.endpoint == pool._names[other], (moved.endpoint, pool._names)
    return {"pages": pages, "mode": "carried" if carry else "cold", "case": case,
            "conversation_tokens": first.usage.prompt_tokens,
            "moved_prompt_tokens": moved.usage.prompt_tokens,
            "moved_computed_tokens": moved.usage.prompt_tokens - moved.usage.cached_tokens,
            "moved_wall_s": round(wall, 3)}


async def measure(urls: list[str], sizes: list[int], reps: int) -> tuple[list[dict[str, Any]],
                                                                        dict[str, int]]:
    backends = [LlamaCppBackend(u) for u in urls]
    pool = EndpointPool(list(backends), load_factor=1.0)
    rows: list[dict[str, Any]] = []
    try:
        for b in backends:  # the warm-up probe, as preflight: it turns slot pinning on
            await b.probe_cache(ModelRequest(model=MODEL, max_tokens=1, agent_key="w",
                                             messages=[{"role": "system", "content": SYSTEM},
                                                       {"role": "user", "content": "ok"}]))
        n = 0
        for pages in sizes:
            for rep in range(reps):
                for carry in (True, False) if rep % 2 == 0 else (False, True):
                    n += 1
                    row = await trial(pool, f"c{n}", pages, carry)
                    print(row, flush=True)
                    rows.append(row)
        return rows, pool.carries()
    finally:
        await pool.aclose()


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pages in sorted({r["pages"] for r in rows}):
        mine = [r for r in rows if r["pages"] == pages]
        by = {m: [r for r in mine if r["mode"] == m] for m in ("carried", "cold")}
        med = {m: {k: median([r[k] for r in rs]) for k in
                   ("conversation_tokens", "moved_computed_tokens", "moved_wall_s")}
               for m, rs in by.items()}
        out[f"pages_{pages}"] = {
            **{f"{m}_{k}_median": v for m, d in med.items() for k, v in d.items()},
            "trials_each": len(by["carried"]),
            "carried_wall_over_cold": ratio(med["carried"]["moved_wall_s"],
                                            med["cold"]["moved_wall_s"]),
            "carried_computed_tokens_over_cold": ratio(
                med["carried"]["moved_computed_tokens"], med["cold"]["moved_computed_tokens"]),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", default="2,6", help="conversation sizes, in ~360-token pages")
    ap.add_argument("--reps", type=int, default=3, help="trials of each mode per size")
    ap.add_argument("--json", default="benchmarks/results/slot_carry.json")
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error(f"--reps must be at least 1, got {args.reps}")
    sizes = [int(p) for p in args.pages.split(",") if p]
    started = time.perf_counter()
    cpus = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="agentbatch-slots-") as shared:
        servers = [LlamaServer(parallel=2, threads=1, cpus=(i % cpus,),
                               extra_args=("--slot-save-path", shared)) for i in range(2)]
        for s in servers:
            s.start()
        try:
            rows, carries = asyncio.run(measure([s.llamacpp_url for s in servers], sizes,
                                                args.reps))
            commands = [s.command() for s in servers]
        finally:
            for s in servers:
                s.stop()
    report = {"benchmark": "slot_carry", "created": utc_now(), "machine": machine_info(),
              "command": "python -m benchmarks.bench_slot_carry " + " ".join(
                  argv if argv is not None else sys.argv[1:]),
              "engine": {"server_commands": commands, "model": "SmolLM2-135M-Instruct Q4_1"},
              "carries": carries, "summary": summarise(rows), "trials": rows,
              "total_s": round(time.perf_counter() - started, 1)}
    print(write_json(args.json, report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
