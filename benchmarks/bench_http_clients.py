"""Client CPU per request of three asyncio HTTP set-ups at 200 concurrent connections.

    python -m benchmarks.bench_http_clients --json benchmarks/results/http_clients.json

``--concurrency`` (200) concurrent POSTs to the simulator's ``/v1/chat/completions``, for
``--rounds`` (5) rounds, with (a) one ``httpx.AsyncClient`` (limits 1000), (b) 8 httpx clients
with requests sharded round-robin, (c) one ``aiohttp.ClientSession``. Every variant sends
the same bytes (the first turn of the ``tool_roundtrip`` workload: tools + response_format)
and decodes the JSON reply the same way. Variants are interleaved over ``--repeats`` and the
simulator runs in its own process, so the CPU measured (``time.process_time``) is the
client's alone. This is why agentbatch's OpenAI-compatible backend moved to aiohttp.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

from benchmarks.machine import RESULTS_DIR, Stopwatch, machine_info, median, utc_now, write_json
from benchmarks.workloads import (
    MODEL,
    SYSTEM_PROMPT,
    TOOL_DESCRIPTION,
    TOOL_NAME,
    TOOL_PARAMETERS,
    get_workload,
)

Post = Callable[[int, bytes], Awaitable[dict[str, Any]]]
HEADERS = {"Content-Type": "application/json"}


def request_bodies(n: int) -> list[bytes]:
    """The first model turn of ``n`` distinct ``tool_roundtrip`` agents, as JSON bytes."""
    wl = get_workload("tool_roundtrip")
    return [_body(wl.task.format(**item), wl.schema) for item in wl.inputs(n)]


def _body(task: str, schema: Any) -> bytes:
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM_PROMPT},
                     {"role": "user", "content": task}],
        "tools": [{"type": "function", "function": {"name": TOOL_NAME,
                                                    "description": TOOL_DESCRIPTION,
                                                    "parameters": TOOL_PARAMETERS}}],
        "response_format": {"type": "json_schema", "json_schema": {
            "name": schema.__name__, "schema": schema.model_json_schema()}},
    }
    return json.dumps(body).encode()


async def _httpx_clients(stack: AsyncExitStack, url: str, shards: int, limit: int) -> Post:
    import httpx

    per = max(1, limit // shards)
    clients = [
        await stack.enter_async_context(httpx.AsyncClient(
            limits=httpx.Limits(max_connections=per, max_keepalive_connections=per),
            timeout=60.0))
        for _ in range(shards)
    ]

    async def post(i: int, data: bytes) -> dict[str, Any]:
        resp = await clients[i % shards].post(url, content=data, headers=HEADERS)
        resp.raise_for_status()
        return json.loads(resp.content)

    return post


async def _aiohttp_session(stack: AsyncExitStack, url: str, limit: int) -> Post:
    import aiohttp

    session = await stack.enter_async_context(aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=limit),
        timeout=aiohttp.ClientTimeout(total=60.0)))

    async def post(i: int, data: bytes) -> dict[str, Any]:
        async with session.post(url, data=data, headers=HEADERS) as resp:
            resp.raise_for_status()
            return json.loads(await resp.read())

    return post


CLIENTS: dict[str, tuple[str, Callable[[AsyncExitStack, str], Awaitable[Post]]]] = {
    "httpx": ("one httpx.AsyncClient (limits 1000)",
              lambda st, url: _httpx_clients(st, url, 1, 1000)),
    "httpx_sharded": ("8 httpx.AsyncClients, round-robin (limits 125 each)",
                      lambda st, url: _httpx_clients(st, url, 8, 1000)),
    "aiohttp": ("one aiohttp.ClientSession (TCPConnector limit 1000)",
                lambda st, url: _aiohttp_session(st, url, 1000)),
}


async def _one_variant(name: str, url: str, bodies: list[bytes], rounds: int) -> dict[str, Any]:
    per_round = []
    ok = 0
    gc.collect()
    async with AsyncExitStack() as stack:
        with Stopwatch() as total:
            post = await CLIENTS[name][1](stack, url)
            for _ in range(rounds):
                with Stopwatch() as sw:
                    replies = await asyncio.gather(*(post(i, b) for i, b in enumerate(bodies)),
                                                   return_exceptions=True)
                ok += sum(1 for r in replies if isinstance(r, dict))
                per_round.append({"wall_s": sw.wall_s,
                                  "cpu_ms_per_request": 1e3 * sw.cpu_s / len(bodies)})
    requests = rounds * len(bodies)
    return {
        "wall_s": total.wall_s,
        "cpu_s": total.cpu_s,
        "cpu_ms_per_request": 1e3 * total.cpu_s / requests,
        "requests": requests,
        "ok": ok,
        "rounds": per_round,
    }


def run_benchmark(concurrency: int, rounds: int, repeats: int, fixed_ms: float,
                  names: list[str], log: Callable[[str], None] = print) -> dict[str, Any]:
    from agentbatch.sim.config import SimConfig
    from agentbatch.sim.process import SimProcess

    bodies = request_bodies(concurrency)
    info = machine_info()
    results: dict[str, dict[str, Any]] = {n: {"label": CLIENTS[n][0], "runs": []} for n in names}
    with SimProcess(SimConfig(fixed_ms=fixed_ms)) as sim:
        url = sim.url + "/v1/chat/completions"
        for rep in range(repeats):
            for name in names:
                rec = {"repeat": rep + 1, **asyncio.run(_one_variant(name, url, bodies, rounds))}
                results[name]["runs"].append(rec)
                log(f"repeat {rep + 1} {name:14s} wall={rec['wall_s']:.3f}s "
                    f"cpu={rec['cpu_ms_per_request']:.2f}ms/request ok={rec['ok']}")
    for res in results.values():
        res["median"] = {f: median([r[f] for r in res["runs"]])
                         for f in ("wall_s", "cpu_s", "cpu_ms_per_request", "requests", "ok")}
    base = results.get("aiohttp", {}).get("median", {}).get("cpu_ms_per_request")
    ratios = {f"{n}_cpu_per_request_over_aiohttp": (r["median"]["cpu_ms_per_request"] / base
                                                    if base else None)
              for n, r in results.items() if n != "aiohttp"}
    return {
        "benchmark": "http_clients",
        "created": utc_now(),
        "concurrency": concurrency,
        "rounds": rounds,
        "repeats": repeats,
        "fixed_ms": fixed_ms,
        "machine": info,
        "clients": results,
        "ratios": ratios,
        "notes": ["cpu_ms_per_request = client-process CPU over all rounds (client set-up and "
                  "first connections included) / requests; per-round values are in 'rounds'."],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_http_clients",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--fixed-ms", type=float, default=60.0)
    p.add_argument("--clients", default=",".join(CLIENTS))
    p.add_argument("--json", default=str(RESULTS_DIR / "http_clients.json"))
    args = p.parse_args(argv)
    names = [n.strip() for n in args.clients.split(",") if n.strip()]
    if bad := [n for n in names if n not in CLIENTS]:
        p.error(f"unknown clients {bad}; known: {', '.join(CLIENTS)}")
    data = run_benchmark(args.concurrency, args.rounds, args.repeats, args.fixed_ms, names,
                         log=lambda m: print(m, file=sys.stderr))
    out = write_json(args.json, data)
    from benchmarks.report import render_file

    print(render_file(data))
    print(f"\nwrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
