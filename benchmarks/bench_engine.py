"""agentbatch vs the peers on the real engine: llama.cpp's ``llama-server`` with SmolLM2-135M.

    python -m benchmarks.bench_engine --rounds 3 \
        --systems embedded,embedded_unstreamed,embedded_batched,distributed,\
distributed_uncapped,naive,naive_stream,batch_agent \
        --workloads structured:40:3,tools:40:3,structured:200:2 \
        --stream-workloads structured:40 --max-tokens 96 --timeout 600 \
        --json benchmarks/results/engine.json

The results file
is rewritten after every run with ``"complete": false`` until the last one, so a run stopped
early still leaves the rounds it finished.

With ``--max-tokens 64`` most first replies of the tools workload were cut off inside the JSON
(pretty-printed by llama.cpp's schema grammar), so most agents spent a turn on a repair; 96
is the default.

One invocation starts one ``llama-server`` (``LlamaServer``: 4 slots, ``-t 1`` on this 2-core
machine), one throwaway redis-server and a distributed fleet (2 inference + 1 tool
``agentbatch worker`` processes), then runs, round-robin per round (the starting system rotates
each round), every system on every workload against that same server:

* ``embedded``: ``arun_batch`` with a ``llamacpp://`` backend (which streams turns by
  default, so a reply that loops is stopped: ``backends/loop_guard.py``);
* ``embedded_unpinned``: ``embedded`` with no turn pinned to a slot (``id_slot``), as
  before issue 26 (the warm-up probe still runs);
* ``embedded_unstreamed``: the same with ``?stream=0``: whole replies, no loop guard;
* ``distributed``: ``submit_batch(..., redis_url=...).wait()`` on the fleet (fleet start-up is
  outside the timed window, as a deployed fleet would be running already);
* ``distributed_uncapped``: ``distributed`` with ``max_inflight=256`` (the default cap before
  the fleet's workers read llama.cpp's slot count): every turn goes to llama-server as soon
  as a worker takes it, and waits in its first-come queue;
* ``naive``: ``asyncio.gather`` over one loop per agent on ``openai.AsyncOpenAI`` (its
  defaults: 2 retries), as a user writes it. Same system message, same schemas (the ones
  agentbatch sends), ``response_format`` json_schema, one repair turn (agentbatch gets the same
  budget: ``max_retries=1``). On (b) it speaks the same json tool protocol as
  ``tool_calling="json"`` (same union schema, same system text, same rendering of tool
  results, the model's own reply made compact as the assistant turn), forces the first call as
  ``tool_choice="required"`` does, and runs every tool call itself: no coalescing;
* ``embedded_stream`` / ``naive_stream``: the same with every turn streamed (``?stream=1`` on
  the backend URL, as ``embedded`` now does by default; ``"stream": true`` and an SSE reader
  in the naive loop), for TTFT: the
  backend's ``ModelResponse.ttft_s`` (heard through ``llamacpp.observe_ttft``) and, naive, the
  time to the first content delta. Only on ``--stream-workloads``;
* ``embedded_batched``: ``embedded`` with ``batch_prompting=True`` (several agents' turns in
  one ``/v1/completions`` request, each prompt in the server's chat template and under the
  schema); structured workload only;
* ``batch_agent``: ``batch-agent`` 0.2.0 from PyPI, ``vllm://`` backend pointed at the same
  server (llama-server is OpenAI-compatible), its own defaults otherwise (schema as plain text
  in the system prompt, native tools, streamed turns), ``max_retries=1``.

Issue 26 item 4 (a server as users start it), written to its own results file:

    python -m benchmarks.bench_engine --server-defaults --parallel 8 --threads 1 \
        --server-cpus 0 --client-cpus 1 --systems embedded,naive --workloads capitals:40:3 \
        --max-tokens 80 --json benchmarks/results/engine_default_flags.json

``--server-defaults`` starts llama-server without ``--slot-prompt-similarity 0`` (llama.cpp
picks slots by prompt similarity, its default) and with its default context (``-c 0``: the
model's, shared by the slots); ``--server-cpus`` / ``--client-cpus`` pin the
server and this process to CPUs. The ``capitals`` workload is N agents with one structured
turn each (a repair allowed) sharing a ~280-token system prompt.

Issue 26 items 1 and 3 (a pool of llama-servers), written to its own results file:

    python -m benchmarks.bench_engine --pool 2 --threads 1 --parallel 2 \
        --systems embedded,embedded_least_outstanding,distributed,naive_round_robin,naive_hash \
        --workloads longconv:4:3,tools:16:3 --max-tokens 64 --timeout 500 \
        --json benchmarks/results/engine_pool.json

(The committed run adds ``distributed`` to ``--systems``: 25 minutes on a 2-core machine;
``--system-rounds distributed:1`` gives it one round instead.)

``--pool N`` starts N llama-servers, each pinned to its own CPU, and every agentbatch system
gets ``backend=[url1, url2, ...]``; ``embedded_least_outstanding`` is ``embedded`` with
``pool_routing="least_outstanding"``; ``naive_round_robin`` sends each turn to the next
server, ``naive_hash`` pins each agent to one server (agent i on server i mod N: the even
split a hash gives only on average; see ``pinned_server``). Engine counters
are summed over the servers, with each server's share (``per_server``, ``busy_max_over_mean``)
and agentbatch embedded's ``moves``. The ``longconv`` workload: 4 agents (the committed run;
3 before, which no routing can split evenly over 2 servers) each read a 6-page
manual (~1.1 KB a page) with ``read_page``, one page per turn; every system forces the six
reads (see ``REQUIRED_CALLS``). ``valid`` there is the number of agents whose seventh turn
was a final answer that validated as ``ManualReport``: SmolLM2-135M calls ``read_page`` again
instead, so every system ends each agent at ``max_turns`` after 7 turns (agentbatch:
``max_turns`` error; naive: the same rule) and valid is 0 for all of them. The work is the
same 7 turns per agent for every system, which is what the pool's routing is measured on.
``embedded_no_probe`` is ``embedded`` with ``warm_prefix=False`` (no warm-up cache probe on
the servers, no ``id_slot``). The pool systems patch nothing: ``embedded_least_outstanding``
is the batch option ``pool_routing="least_outstanding"``, and the six forced reads are
``tool_choice="required"`` with ``required_tool_rounds=6``, as a user would set them.

Workloads: (a) ``structured``: N structured-output agents sharing a ~350-token system prompt;
(b) ``tools``: 40 agents, one 200 ms tool whose key is shared 10 ways (its argument is one of 4
item names, an ``enum``), through ``tool_calling="json"`` with ``tool_choice="required"``: every
agent calls the tool, then answers. The task needs one call per reply, so both systems send
the union schema with ``maxItems: 1`` (agentbatch: ``max_tool_calls_per_turn=1``). agentbatch's
``llamacpp://`` backend sends schemas as a whitespace-free grammar (``compact_json``) and
prefills the forced start of each reply (``jump_forward``); naive sends ``response_format``.
Per run: wall, agents/s, valid outputs, the engine's own
``/metrics`` counter deltas (prompt tokens, cached prompt tokens, generated tokens, and each
per model turn; its decode calls and the seconds its slots spent on prompts and on
generating: where the engine's time goes), TTFT p50/p95 for the streamed systems, client CPU
(this process, plus the workers for ``distributed``) per model turn, and ratios to naive at the
median. Not part of the pytest suite.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import signal
import sys
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args
from unittest.mock import patch

from pydantic import BaseModel, Field, ValidationError

from agentbatch import arun_batch, asubmit_batch, submit_batch, tool
from agentbatch.backends.llamacpp import SlotPicker, observe_ttft
from agentbatch.backends.prom import metric_sum, parse_prometheus
from agentbatch.core.options import DEFAULT_MAX_INFLIGHT
from agentbatch.core.output import OutputContract
from agentbatch.turnloop.compile import system_message
from agentbatch.turnloop.json_tool_calling import (
    RESULTS_FOOTER,
    RESULTS_HEADER,
    instructions,
    union_schema,
)
from benchmarks.machine import machine_info, median, ratio, rotated, utc_now, write_json
from tests.engine.reviews import REVIEWS
from tests.engine.reviews import TASK as TASK_A

if TYPE_CHECKING:  # the naive client's package: imported where it runs (the bench extra)
    from openai import AsyncOpenAI

MODEL = "smollm2"
SYSTEMS = ("embedded", "embedded_unpinned", "embedded_unstreamed", "distributed",
           "distributed_uncapped", "naive",
           "batch_agent",
           "embedded_stream", "naive_stream", "embedded_batched")
# Issue 26 pool mode (``--pool N``): N llama-servers, ``backend=[url1, url2, ...]``.
POOL_SYSTEMS = ("embedded_least_outstanding", "naive_round_robin", "naive_hash",
                "embedded_no_probe")
SYSTEMS = SYSTEMS + POOL_SYSTEMS
POOL_DEFAULT_SYSTEMS = ("embedded", "embedded_least_outstanding", "distributed",
                        "naive_round_robin", "naive_hash")
STREAMED = ("embedded_stream", "naive_stream")
STRUCTURED_ONLY = ("embedded_batched",)
STRUCTURED_WORKLOADS = ("structured", "capitals")
WORKER_IMPORTS = "benchmarks.bench_engine,agentbatch.toolpool.builtins"

# ~350 tokens with SmolLM2's tokenizer (measured from the engine's prompt_tokens counter).
SYSTEM_A = (
    "You label short product reviews for a shop. Read the review, decide whether the customer "
    "was happy, and give a very short reason in plain words. " * 11
).strip()

# ~280 tokens: the issue 26 capitals workload's shared system prompt.
SYSTEM_C = (
    "You are a geography assistant for a school quiz. Answer with the capital city of the "
    "country you are asked about, spelled the way an English atlas spells it. " * 8
).strip()
TASK_C = "Quiz question {i}: what is the capital of {country}?"
COUNTRIES = ["France", "Japan", "Brazil", "Kenya", "Canada", "India", "Norway", "Chile",
             "Egypt", "Vietnam", "Peru", "Spain", "Italy", "Ghana", "Nepal", "Cuba",
             "Poland", "Greece", "Mexico", "Turkey"]

SYSTEM_B = ("You are a shop assistant. You do not know any prices: to learn the price of an "
            "item, call the price tool with the item's name. After the tool result arrives, "
            "give the final answer with the item and its price.")
TASK_B = "What is the price of the {item}? (ticket {i})"
# 40 agents: each key shared 10 ways. The tool takes the item's name from this list (an
# ``enum`` in its schema, as a shop's catalogue would): with a free string SmolLM2-135M wrote
# names such as "the_item_name_2004_2005_2006..." until the loop guard or max_tokens stopped
# it, so no two agents shared a key and most never got a tool result.
Item = Literal["kettle", "toaster", "blender", "mixer"]
ITEMS: list[str] = list(get_args(Item))
TOOL_S = 0.2
# The task needs one call per reply: the turn schema both systems send allows one (agentbatch:
# ``max_tool_calls_per_turn``); without the cap SmolLM2 repeated the call 2-4 times per reply.
MAX_CALLS_B = 1
# (c) ``longconv``: a long conversation. The agent reads a 6-page manual one page per turn
# (``read_page``, ~1.4 KB per page), then answers: 7+ model turns, each prompt the whole
# conversation so far, where a server that still holds the agent's prefix computes only the
# newest page.
SYSTEM_L = ("You read a manual one page at a time with the read_page tool: first page 1, "
            "then page 2, and so on up to page 6. Only after reading page 6, give the final "
            "answer: how many pages you read and a short summary.")
TASK_L = "Read the manual for case {i}, page by page, then summarise it."
Page = Literal[1, 2, 3, 4, 5, 6]
PAGES = len(get_args(Page))
MAX_TURNS_L = PAGES + 1  # six reads, then the answer
LONG_TOOL_S = 0.05
_PAGE_BODY = (
    "Section {page}.{n}: the pump must be primed before first use; check the seal, the "
    "valve and the filter, and write the reading in the log book with the date. "
)
MAX_TURNS = {"tools": 3, "longconv": MAX_TURNS_L}  # agentbatch's max_turns = naive's limit
# Tool rounds an agent must take before it may answer: ``tool_choice="required"`` forces them
# (``required_tool_rounds``); SmolLM2-135M answers after page 1 whatever the prompt says
# (measured: 2 turns per agent with three phrasings), so on ``longconv`` both systems force
# all six reads.
REQUIRED_CALLS = {"tools": 1, "longconv": PAGES}
# The naive loop allows one repair turn per agent; agentbatch gets the same budget, so both
# do the same work (agentbatch's default is 2).
MAX_RETRIES = 1


class Verdict(BaseModel):
    label: Literal["positive", "negative"]
    reason: str = Field(max_length=40)


class Capital(BaseModel):
    country: str = Field(max_length=20)
    capital: str = Field(max_length=30)


class PriceReport(BaseModel):
    item: str = Field(max_length=20)
    price: str = Field(max_length=40)


class ManualReport(BaseModel):
    pages_read: int
    summary: str = Field(max_length=60)


EXECUTIONS: dict[str, int] = {}  # tool executions in this process (not the workers)


async def _price_body(item: Item) -> str:
    """The tool's work (200 ms), also run by the naive loop, once per call."""
    EXECUTIONS[item] = EXECUTIONS.get(item, 0) + 1
    await asyncio.sleep(TOOL_S)
    return f"{item} costs 12 euros"


@tool(cacheable=True)  # 200 ms; cacheable, so agentbatch shares it within a batch
async def price(item: Item) -> str:
    """The price of an item in the shop.

    Args:
        item: the item's name.
    """
    return await _price_body(item)


def page_text(page: int) -> str:
    """One page of the manual: ~1.4 KB, ending with where to go next."""
    body = "".join(_PAGE_BODY.format(page=page, n=n) for n in range(1, 8))
    nxt = (f"Next: call read_page with page {page + 1}." if page < PAGES
           else "This was the last page: give the final answer now.")
    return f"Page {page} of {PAGES}. {body}{nxt}"


async def _read_page_body(page: Page) -> str:
    """The long-conversation tool's work (50 ms), also run by the naive loop."""
    EXECUTIONS[f"page{page}"] = EXECUTIONS.get(f"page{page}", 0) + 1
    await asyncio.sleep(LONG_TOOL_S)
    return page_text(page)


@tool
async def read_page(page: Page) -> str:
    """Read one page of the manual.

    Args:
        page: the page number, 1 to 6.
    """
    return await _read_page_body(page)


BODIES = {"price": _price_body, "read_page": _read_page_body}


def inputs(workload: str, n: int, run: int) -> list[dict[str, Any]]:
    """Per-agent inputs; ``run`` makes every run's user messages new to the engine's prompt
    cache (only the shared system prompt stays cached), so no system inherits a cache filled
    by the one before it."""
    base = 1000 * (run + 1)
    if workload == "structured":
        return [{"i": base + i, "text": REVIEWS[i % len(REVIEWS)]} for i in range(n)]
    if workload == "capitals":
        return [{"i": base + i, "country": COUNTRIES[i % len(COUNTRIES)]} for i in range(n)]
    if workload == "longconv":
        return [{"i": base + i} for i in range(n)]
    return [{"i": base + i, "item": ITEMS[i % len(ITEMS)]} for i in range(n)]


def scrape(http_url: str) -> dict[str, float]:
    """The engine's own counters (llama.cpp ``/metrics``)."""
    with urllib.request.urlopen(f"{http_url}/metrics", timeout=30) as resp:
        samples = parse_prometheus(resp.read().decode())
    names = ("prompt_tokens_total", "prompt_tokens_cached_total", "tokens_predicted_total",
             # where the engine's time goes: its llama_decode calls (one batched step each),
             # and the seconds its slots spent on prompts and on generating (summed over slots)
             "n_decode_total", "prompt_seconds_total", "tokens_predicted_seconds_total")
    return {n: metric_sum(samples, f"llamacpp:{n}") or 0.0 for n in names}


def wait_idle(http_url: str, deadline_s: float = 180.0) -> None:
    """Wait until the engine has nothing in flight (a timed-out run's requests may linger)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{http_url}/metrics", timeout=30) as resp:
            samples = parse_prometheus(resp.read().decode())
        busy = sum(metric_sum(samples, f"llamacpp:{n}") or 0.0
                   for n in ("requests_processing", "requests_deferred"))
        if busy == 0:
            return
        time.sleep(0.5)
    raise TimeoutError(f"llama-server still busy after {deadline_s} s")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process and its reaped children."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(fields[i]) for i in (11, 12, 13, 14)) / os.sysconf("SC_CLK_TCK")


# --- the systems -------------------------------------------------------------------------


def _ab_kwargs(workload: str, n: int, max_tokens: int, run: int) -> dict[str, Any]:
    common: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0.0}
    if workload == "structured":
        return {"task": TASK_A, "inputs": inputs(workload, n, run), "system_prompt": SYSTEM_A,
                "output_schema": Verdict, "max_turns": 2, "max_retries": MAX_RETRIES,
                **common}
    if workload == "capitals":
        return {"task": TASK_C, "inputs": inputs(workload, n, run), "system_prompt": SYSTEM_C,
                "output_schema": Capital, "max_turns": 2, "max_retries": MAX_RETRIES,
                **common}
    if workload == "longconv":
        return {"task": TASK_L, "inputs": inputs(workload, n, run), "system_prompt": SYSTEM_L,
                "output_schema": ManualReport, "tools": [read_page], "tool_calling": "json",
                "tool_choice": "required", "required_tool_rounds": REQUIRED_CALLS[workload],
                "max_turns": MAX_TURNS_L, "max_retries": MAX_RETRIES,
                "max_tool_calls_per_turn": MAX_CALLS_B, **common}
    return {"task": TASK_B, "inputs": inputs(workload, n, run), "system_prompt": SYSTEM_B,
            "output_schema": PriceReport, "tools": [price], "tool_calling": "json",
            "tool_choice": "required", "max_turns": 3, "max_retries": MAX_RETRIES,
            "max_tool_calls_per_turn": MAX_CALLS_B, **common}


def _tally(results: list[Any], schema: type[BaseModel]) -> dict[str, Any]:
    ok = [r for r in results if r.ok and isinstance(r.output, schema)]
    calls = [c for r in results for c in r.tool_calls]
    return {"valid": len(ok), "turns": sum(r.turns for r in results),
            "tool_calls": len(calls),
            "agents_calling_tools": sum(1 for r in results if r.tool_calls),
            "tool_calls_shared": sum(1 for c in calls if c.cached or c.coalesced),
            "errors": sorted({f"{r.error.kind}: {r.error.message}"[:160]
                              for r in results if not r.ok and r.error})[:3]}


async def run_embedded(ctx: dict[str, Any], workload: str, n: int,
                       url_options: str = "", **options: Any) -> dict[str, Any]:
    kw = {**_ab_kwargs(workload, n, ctx["max_tokens"], ctx["run"]), **options}
    task = kw.pop("task")
    ttfts: list[float] = []  # heard only from streamed turns (the llamacpp:// default)
    url = ctx["llamacpp_url"]
    if isinstance(url, list):  # a pool (``--pool``): arun_batch's path, keeping the handle
        with observe_ttft(ttfts.append):
            handle = await asubmit_batch(task, kw.pop("inputs"),
                                         backend=[u + url_options for u in url], **kw)
            async with handle:
                results = await handle.wait_async()
        pool = handle.stats().get("pool") or {}
        tally = {**_tally(results, kw["output_schema"]), "pool_moves": pool.get("moves"),
                 "pool_requests": {name: ep["requests"]
                                   for name, ep in (pool.get("endpoints") or {}).items()},
                 "cache_probes": _cache_probes(handle)}
    else:
        with observe_ttft(ttfts.append):
            results = await arun_batch(task, kw.pop("inputs"), backend=url + url_options, **kw)
        tally = _tally(results, kw["output_schema"])
    return {**tally, "ttfts": ttfts} if ttfts else tally


def _cache_probes(handle: Any) -> list[dict[str, Any]]:
    """What each server's warm-up cache probe saw, and whether its turns were pinned to
    slots (``id_slot``): issue 26 item 2."""
    from agentbatch.backends.setup import endpoints

    engine = getattr(handle, "engine", None)
    if engine is None:
        return []
    out = []
    for ep in endpoints(engine.rt.backend):
        probe = getattr(ep, "cache_probe", None)
        out.append({"endpoint": ep.name, "pinned_turns": getattr(ep, "_picker", None) is not None,
                    **({"prompt_tokens": probe.prompt_tokens,
                        "unpinned_cached": probe.unpinned_cached,
                        "pinned_cached": probe.pinned_cached} if probe is not None else {})})
    return out


async def run_embedded_least_outstanding(ctx: dict[str, Any], workload: str,
                                         n: int) -> dict[str, Any]:
    """``embedded`` on a pool with ``pool_routing="least_outstanding"`` (every turn to the
    endpoint with the fewest in flight, no affinity)."""
    return await run_embedded(ctx, workload, n, pool_routing="least_outstanding")


async def run_embedded_unpinned(ctx: dict[str, Any], workload: str, n: int) -> dict[str, Any]:
    """``embedded`` with no turn pinned to a slot (``SlotPicker`` never picks), as agentbatch
    sent turns before issue 26: the server's own slot selection decides."""
    with patch.object(SlotPicker, "acquire", lambda self, key: None):
        return await run_embedded(ctx, workload, n)


async def run_embedded_no_probe(ctx: dict[str, Any], workload: str, n: int) -> dict[str, Any]:
    """``embedded`` with ``warm_prefix=False``: no warm-up cache probe on each server, so no
    turn is pinned to a slot (``id_slot``) either; llama.cpp's least-recently-used slot
    selection and its host-memory prompt cache place every turn, as for the naive clients
    (issue 26 item 2: what the probe and the pinning cost on a pool)."""
    return await run_embedded(ctx, workload, n, warm_prefix=False)


async def run_embedded_unstreamed(ctx: dict[str, Any], workload: str,
                                  n: int) -> dict[str, Any]:
    """``embedded`` reading whole replies (``?stream=0``), so without the loop guard."""
    return await run_embedded(ctx, workload, n, "?stream=0")


async def run_embedded_batched(ctx: dict[str, Any], workload: str, n: int) -> dict[str, Any]:
    """``embedded`` with ``batch_prompting=True``: up to ``total_slots`` agents' turns per
    ``/v1/completions`` request, each prompt rendered with the server's chat template and
    constrained by the schema (``json_schema``). Structured workload only (issue 9, item 4:
    valid and no slower than plain turns)."""
    kw = _ab_kwargs(workload, n, ctx["max_tokens"], ctx["run"])
    task = kw.pop("task")
    results = await arun_batch(task, kw.pop("inputs"), backend=ctx["llamacpp_url"],
                               batch_prompting=True, **kw)
    return _tally(results, kw["output_schema"])


async def run_embedded_stream(ctx: dict[str, Any], workload: str, n: int) -> dict[str, Any]:
    """``embedded`` with ``?stream=1`` said explicitly; TTFT per turn from the backend."""
    kw = _ab_kwargs(workload, n, ctx["max_tokens"], ctx["run"])
    task = kw.pop("task")
    ttfts: list[float] = []
    with observe_ttft(ttfts.append):
        results = await arun_batch(task, kw.pop("inputs"),
                                   backend=ctx["llamacpp_url"] + "?stream=1", **kw)
    return {**_tally(results, kw["output_schema"]), "ttfts": ttfts}


async def run_distributed(ctx: dict[str, Any], workload: str, n: int,
                          **options: Any) -> dict[str, Any]:
    kw = {**_ab_kwargs(workload, n, ctx["max_tokens"], ctx["run"]), **options}
    task = kw.pop("task")
    items = kw.pop("inputs")

    def submit_and_wait() -> list[Any]:  # the sync API, off this event loop (as a user would)
        return submit_batch(task, items, backend=ctx["llamacpp_url"],
                            redis_url=ctx["redis_url"], **kw).wait(timeout=ctx["timeout"])

    results = await asyncio.to_thread(submit_and_wait)
    return _tally(results, kw["output_schema"])


async def run_distributed_uncapped(ctx: dict[str, Any], workload: str,
                                   n: int) -> dict[str, Any]:
    """``distributed`` as it was before the fleet took llama.cpp's slot count as its cap:
    every turn sent as soon as a worker has it (``max_inflight`` at the default 256)."""
    return await run_distributed(ctx, workload, n, max_inflight=DEFAULT_MAX_INFLIGHT)


def _rf(schema: dict[str, Any], name: str) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


async def _naive_chat(client: AsyncOpenAI, body: dict[str, Any],
                      ttfts: list[float] | None) -> str:
    """One chat completion as a user writes it with ``AsyncOpenAI`` (its own retries: 2);
    streamed when ``ttfts`` is given, which then gets the time to the first content delta."""
    if ttfts is None:
        reply = await client.chat.completions.create(**body)
        return reply.choices[0].message.content or ""
    parts: list[str] = []
    started = time.perf_counter()
    stream = await client.chat.completions.create(**body, stream=True)
    async for chunk in stream:
        for choice in chunk.choices:
            piece = choice.delta.content
            if piece:
                if not parts:
                    ttfts.append(time.perf_counter() - started)
                parts.append(piece)
    return "".join(parts)


async def _naive_agent(client: AsyncOpenAI, ctx: dict[str, Any], workload: str,
                       item: dict[str, Any], tally: dict[str, int],
                       ttfts: list[float] | None = None) -> bool:
    """One agent, written by hand: model turn, tools, model turn, validate, one repair.

    On (b) it speaks the json tool protocol agentbatch speaks, and forces the tool call as
    agentbatch's ``tool_choice="required"`` does: until the agent has called the tool, the
    turn's schema allows only calls. The assistant turn is the model's reply made compact,
    in the model's key order, as agentbatch's json mode sends it: the same prompts. (Sent
    back as it came, pretty-printed under ``response_format``, SmolLM2 took 111 turns for
    40 agents instead of 80 in one run: 114.6 s.)"""
    if workload in ("structured", "capitals"):
        schema: type[BaseModel] = Verdict if workload == "structured" else Capital
        system = system_message(SYSTEM_A if workload == "structured" else SYSTEM_C,
                                OutputContract(schema))
        task = (TASK_A if workload == "structured" else TASK_C).format(**item)
        turn_schema = final_schema = calls_schema = schema.model_json_schema()
    else:
        schema = PriceReport if workload == "tools" else ManualReport
        tools = [(price if workload == "tools" else read_page).openai_schema()]
        out = OutputContract(schema).json_schema
        system = "\n\n".join([SYSTEM_B if workload == "tools" else SYSTEM_L,
                               instructions(tools, out)])
        task = (TASK_B if workload == "tools" else TASK_L).format(**item)
        # the schemas agentbatch sends (one call per reply: ``max_tool_calls_per_turn``)
        turn_schema = union_schema(tools, out, max_calls=MAX_CALLS_B)
        final_schema = union_schema(tools, out, allow_tools=False)
        calls_schema = union_schema(tools, out, allow_final=False, max_calls=MAX_CALLS_B)
    messages: list[dict[str, Any]] = [{"role": "system", "content": system},
                                      {"role": "user", "content": task}]
    repaired = called = False
    calls_made = 0
    with_tools = workload in MAX_TURNS
    limit = MAX_TURNS.get(workload, 3)  # the last allowed turn must answer (as agentbatch's)
    for turn in range(limit + 1):
        if with_tools and calls_made < REQUIRED_CALLS[workload]:
            turn_rf = calls_schema
        elif workload == "longconv":  # as agentbatch: tools stay allowed on the last turn
            turn_rf = final_schema if repaired else turn_schema
        else:
            turn_rf = final_schema if repaired or turn >= limit - 1 else turn_schema
        body = {"model": MODEL, "messages": messages, "max_tokens": ctx["max_tokens"],
                "temperature": 0.0, "response_format": _rf(turn_rf, "agent_turn")}
        content = await _naive_chat(client, body, ttfts)
        tally["turns"] += 1
        try:
            obj = json.loads(content)
        except ValueError:
            obj = None
        if with_tools and isinstance(obj, dict) and obj.get("tool_calls"):
            if workload == "longconv" and turn >= limit - 1:
                return False  # as agentbatch: "the model still called tools after max_turns"
            calls = obj["tool_calls"]
            tally["tool_calls"] += len(calls)
            tally["agents_calling_tools"] += not called
            called = True
            calls_made += 1
            outs = await asyncio.gather(*(BODIES[c["name"]](**c["arguments"])
                                          for c in calls))
            lines = [json.dumps({"arguments": c["arguments"], "name": c["name"],
                                 "result": o}, separators=(",", ":"),
                                sort_keys=True) for c, o in zip(calls, outs, strict=True)]
            # its own reply, compact and in its key order: the assistant turn agentbatch's
            # json mode sends (the reply itself came pretty-printed under response_format)
            messages.append({"role": "assistant", "content": json.dumps(
                obj, separators=(",", ":"), ensure_ascii=False)})
            messages.append({"role": "user",
                             "content": "\n".join([RESULTS_HEADER, *lines, RESULTS_FOOTER])})
            continue
        try:
            if with_tools and not called:
                raise ValueError("no tool call")
            value = obj["final"] if with_tools else obj
            schema.model_validate(value)
            return True
        except (ValidationError, ValueError, TypeError, KeyError) as exc:
            if repaired:
                return False
            repaired = True
            tally["repairs"] += 1
            messages.append({"role": "assistant", "content": content})
            messages.append({"role": "user", "content": f"That did not validate: {exc}. "
                                                        "Reply with the JSON object only."})
    return False


class _RoundRobin:
    """What a user writes for several servers: each chat completion to the next server's
    ``AsyncOpenAI`` client in turn (``client.chat.completions.create`` of the next one)."""

    def __init__(self, clients: list[AsyncOpenAI]) -> None:
        self._clients = clients
        self._next = 0
        self.chat = self.completions = self

    async def create(self, **body: Any) -> Any:
        client = self._clients[self._next % len(self._clients)]
        self._next += 1
        return await client.chat.completions.create(**body)


def pinned_server(agent: int, servers: int) -> int:
    """The server the pinning naive client (``naive_hash``) sends agent ``agent`` to: its
    number mod the pool size, an even split. A hash of the number splits evenly only on
    average: crc32, used before, put all four agents of ``longconv`` on one server, so that
    client ran on half the pool and any routing looked good against it."""
    return agent % servers


async def run_naive(ctx: dict[str, Any], workload: str, n: int,
                    ttfts: list[float] | None = None, spread: str = "") -> dict[str, Any]:
    """``spread`` over the pool's servers (``--pool``): ``round_robin`` (every turn to the
    next server) or ``hash`` (each agent pinned to one server, ``pinned_server``);
    "" is the one server (the first)."""
    tally = {"turns": 0, "tool_calls": 0, "agents_calling_tools": 0, "repairs": 0}
    urls = (ctx.get("http_urls") or [ctx["http_url"]]) if spread else [ctx["http_url"]]
    from openai import AsyncOpenAI

    clients = [AsyncOpenAI(base_url=u + "/v1", api_key="none") for u in urls]
    rr = _RoundRobin(clients)

    def client_for(item: dict[str, Any]) -> Any:
        if spread == "round_robin":
            return rr
        return clients[pinned_server(item["i"], len(clients))]

    try:
        results = await asyncio.gather(
            *(_naive_agent(client_for(item), ctx, workload, item, tally, ttfts)
              for item in inputs(workload, n, ctx["run"])), return_exceptions=True)
    finally:
        for client in clients:
            await client.close()
    errors = sorted({f"{type(r).__name__}: {r}"[:160] for r in results
                     if isinstance(r, BaseException)})[:3]
    return {"valid": sum(1 for r in results if r is True), **tally, "tool_calls_shared": 0,
            "errors": errors}


async def run_naive_stream(ctx: dict[str, Any], workload: str, n: int) -> dict[str, Any]:
    """``naive`` with ``stream: true`` on every turn, TTFT = time to the first content delta."""
    ttfts: list[float] = []
    return {**await run_naive(ctx, workload, n, ttfts), "ttfts": ttfts}


async def run_batch_agent(ctx: dict[str, Any], workload: str, n: int) -> dict[str, Any]:
    from batch_agent import BatchAgent
    from batch_agent import Tool as BATool
    from batch_agent.backends.vllm import VLLMBackend

    host_port = ctx["http_url"].split("://", 1)[1]
    backend = VLLMBackend.from_url(f"vllm://{host_port}")
    kw: dict[str, Any] = {"model": MODEL, "backend": f"vllm://{host_port}", "runtime": backend,
                          "max_inflight": n, "max_retries": 1}
    if workload == "structured":
        kw.update(task=TASK_A, inputs=inputs(workload, n, ctx["run"]), system_prompt=SYSTEM_A,
                  output_schema=Verdict, max_turns=2)
        schema: type[BaseModel] = Verdict
    else:
        kw.update(task=TASK_B, inputs=inputs(workload, n, ctx["run"]), system_prompt=SYSTEM_B,
                  output_schema=PriceReport, max_turns=3,
                  tools=[BATool.define(_price_body, name="price", cacheable=True)])
        schema = PriceReport
    try:
        results = await BatchAgent.run(**kw)
    finally:
        client = getattr(backend, "_client", None)
        if client is not None:
            await client.aclose()
    return {"valid": sum(1 for r in results if r.ok and isinstance(r.output, schema)),
            "turns": sum(int(getattr(r, "turns", 0) or 0) for r in results) or None,
            "attempts": sum(int(getattr(r, "attempts", 0) or 0) for r in results),
            "errors": sorted({f"{r.error.type}: {r.error.message}"[:160]
                              for r in results if not r.ok and r.error})[:3]}


async def run_naive_round_robin(ctx: dict[str, Any], workload: str, n: int) -> dict[str, Any]:
    return await run_naive(ctx, workload, n, spread="round_robin")


async def run_naive_hash(ctx: dict[str, Any], workload: str, n: int) -> dict[str, Any]:
    return await run_naive(ctx, workload, n, spread="hash")


RUNNERS = {"embedded": run_embedded, "embedded_unpinned": run_embedded_unpinned,
           "embedded_no_probe": run_embedded_no_probe,
           "embedded_least_outstanding": run_embedded_least_outstanding,
           "naive_round_robin": run_naive_round_robin, "naive_hash": run_naive_hash,
           "embedded_unstreamed": run_embedded_unstreamed,
           "distributed": run_distributed, "distributed_uncapped": run_distributed_uncapped,
           "naive": run_naive,
           "batch_agent": run_batch_agent, "embedded_stream": run_embedded_stream,
           "embedded_batched": run_embedded_batched,
           "naive_stream": run_naive_stream}


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


async def one_run(ctx: dict[str, Any], system: str, workload: str, n: int) -> dict[str, Any]:
    timeout = ctx["peer_timeout"] if system == "batch_agent" else ctx["timeout"]
    EXECUTIONS.clear()
    servers = ctx.get("http_urls") or [ctx["http_url"]]  # several with ``--pool``
    for url in servers:
        wait_idle(url)
    fleet = ctx.get("fleet_pids", []) if system.startswith("distributed") else []
    befores = [scrape(url) for url in servers]
    workers_before = sum(cpu_seconds(p) for p in fleet)
    cpu_before = time.process_time()
    started = time.perf_counter()
    try:
        out = await asyncio.wait_for(RUNNERS[system](ctx, workload, n), timeout)
    except TimeoutError:
        out = {"valid": 0, "turns": None, "timed_out": True,
               "errors": [f"cut off after {timeout} s (counted as not valid)"]}
    except Exception as exc:  # one system failing must not lose the other systems' runs
        out = {"valid": 0, "turns": None, "failed": True,
               "errors": [f"{type(exc).__name__}: {exc}"[:300]]}
    wall = time.perf_counter() - started
    cpu = time.process_time() - cpu_before + sum(cpu_seconds(p) for p in fleet) - workers_before
    # each server's own counters, summed over the pool
    per_server = [{k: after[k] - before[k] for k in after}
                  for before, after in zip(befores, [scrape(u) for u in servers], strict=True)]
    delta = {k: sum(d[k] for d in per_server) for k in per_server[0]}
    turns = out.get("turns")
    ttfts = out.pop("ttfts", None)
    if ttfts is not None:
        p50, p95 = percentile(ttfts, 50), percentile(ttfts, 95)
        out.update(ttft_n=len(ttfts), ttft_p50_s=None if p50 is None else round(p50, 3),
                   ttft_p95_s=None if p95 is None else round(p95, 3))
    computed, cached = delta["prompt_tokens_total"], delta["prompt_tokens_cached_total"]
    generated = delta["tokens_predicted_total"]
    row = {"system": system, "workload": workload, "agents": n, "wall_s": round(wall, 3),
           "agents_per_s": round(n / wall, 3), **out,
           "tool_executions_in_process": sum(EXECUTIONS.values()) if workload == "tools"
           else None,
           "engine_prompt_tokens": int(computed),
           "engine_cached_prompt_tokens": int(cached),
           "engine_generated_tokens": int(generated),
           "engine_decode_calls": int(delta["n_decode_total"]),
           "engine_prompt_s": round(delta["prompt_seconds_total"], 2),
           "engine_generate_s": round(delta["tokens_predicted_seconds_total"], 2),
           "engine_computed_prompt_tokens_per_turn": round(computed / turns, 1) if turns
           else None,
           "engine_prompt_tokens_per_turn": round((computed + cached) / turns, 1) if turns
           else None,
           "engine_generated_tokens_per_turn": round(generated / turns, 1) if turns else None,
           "client_cpu_s": round(cpu, 3),
           "loadavg_1m_after": round(os.getloadavg()[0], 2),
           "client_cpu_ms_per_turn": round(cpu / turns * 1000, 2) if turns else None}
    if len(servers) > 1:  # load balance: what each server computed, generated, was busy for
        busy = [d["prompt_seconds_total"] + d["tokens_predicted_seconds_total"]
                for d in per_server]
        row["per_server"] = [
            {"url": url, "prompt_tokens": int(d["prompt_tokens_total"]),
             "cached_prompt_tokens": int(d["prompt_tokens_cached_total"]),
             "generated_tokens": int(d["tokens_predicted_total"]), "busy_s": round(b, 2)}
            for url, d, b in zip(servers, per_server, busy, strict=True)]
        # the busiest server's share of the engine time, over an even share (1.0 = balanced)
        row["busy_max_over_mean"] = (round(max(busy) / (sum(busy) / len(busy)), 3)
                                     if sum(busy) else None)
    print(json.dumps({k: row[k] for k in ("system", "workload", "agents", "wall_s", "valid",
                                          "turns", "engine_prompt_tokens",
                                          "engine_cached_prompt_tokens",
                                          "engine_generated_tokens", "client_cpu_s",
                                          "busy_max_over_mean", "pool_moves")
                       if k in row} | {k: row[k] for k in ("ttft_p50_s", "ttft_p95_s")
                                       if k in row}),
          flush=True)
    return row


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in sorted({(r["workload"], r["agents"]) for r in runs}):
        wl = f"{key[0]}_{key[1]}"
        per: dict[str, Any] = {}
        for system in SYSTEMS:
            rs = [r for r in runs if (r["workload"], r["agents"]) == key and r["system"] == system]
            if not rs:
                continue
            per[system] = {
                "runs": len(rs),
                "timed_out_runs": sum(1 for r in rs if r.get("timed_out")),
                "wall_s_median": median([r["wall_s"] for r in rs]),
                "wall_s_all": [r["wall_s"] for r in rs],
                "agents_per_s_median": median([r["agents_per_s"] for r in rs]),
                "valid_median": median([r["valid"] for r in rs]),
                "engine_prompt_tokens_median": median([r["engine_prompt_tokens"] for r in rs]),
                "engine_cached_prompt_tokens_median": median(
                    [r["engine_cached_prompt_tokens"] for r in rs]),
                "engine_generated_tokens_median": median(
                    [r["engine_generated_tokens"] for r in rs]),
                "client_cpu_ms_per_turn_median": median(
                    [r["client_cpu_ms_per_turn"] for r in rs]),
                "turns_median": median([r["turns"] for r in rs]),
                "engine_decode_calls_median": median([r.get("engine_decode_calls")
                                                      for r in rs]),
                "engine_prompt_s_median": median([r.get("engine_prompt_s") for r in rs]),
                "engine_generate_s_median": median([r.get("engine_generate_s") for r in rs]),
                "engine_generated_tokens_per_turn_median": median(
                    [r["engine_generated_tokens_per_turn"] for r in rs]),
                "engine_prompt_tokens_per_turn_median": median(
                    [r["engine_prompt_tokens_per_turn"] for r in rs]),
            }
            if any("busy_max_over_mean" in r for r in rs):  # ``--pool``
                per[system]["busy_max_over_mean_median"] = median(
                    [r.get("busy_max_over_mean") for r in rs])
                per[system]["valid_all"] = [r["valid"] for r in rs]
                per[system]["engine_prompt_tokens_all"] = [r["engine_prompt_tokens"]
                                                           for r in rs]
            if any(r.get("pool_moves") for r in rs):
                per[system]["pool_moves_all"] = [r.get("pool_moves") for r in rs]
            if any("ttft_p50_s" in r for r in rs):
                per[system]["ttft_p50_s_median"] = median([r.get("ttft_p50_s") for r in rs])
                per[system]["ttft_p95_s_median"] = median([r.get("ttft_p95_s") for r in rs])
        rr = per.get("naive_round_robin", {})
        for s in per.values():
            if rr:  # ``--pool``: against the naive client that round-robins turns
                s["wall_ratio_to_naive_round_robin"] = ratio(s["wall_s_median"],
                                                             rr.get("wall_s_median"))
                s["prompt_tokens_ratio_to_naive_round_robin"] = ratio(
                    s["engine_prompt_tokens_median"], rr.get("engine_prompt_tokens_median"))
            if "naive_hash" in per:
                s["wall_ratio_to_naive_hash"] = ratio(s["wall_s_median"],
                                                      per["naive_hash"]["wall_s_median"])
        naive = per.get("naive", {}).get("wall_s_median")
        naive_stream = per.get("naive_stream", {}).get("wall_s_median")
        naive_prompt = per.get("naive", {}).get("engine_prompt_tokens_median")
        for name, s in per.items():
            s["wall_ratio_to_naive"] = ratio(s["wall_s_median"], naive)
            s["prompt_tokens_ratio_to_naive"] = ratio(s["engine_prompt_tokens_median"],
                                                      naive_prompt)
            if name in STREAMED:
                s["wall_ratio_to_naive_stream"] = ratio(s["wall_s_median"], naive_stream)
        out[wl] = per
    return out


async def amain(args: argparse.Namespace,
                save: Any = lambda runs, server_cmd: None) -> dict[str, Any]:
    """All runs; ``save(runs, server_command)`` after each one, so a run cut short by a
    deadline still leaves what it finished on disk."""
    from agentbatch.engine import LlamaServer
    from tests.support.redis_server import RedisServer
    from tests.support.workers import WorkerProcess

    systems = [s for s in args.systems.split(",") if s]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        raise SystemExit(f"--systems: unknown {', '.join(unknown)} (known: {', '.join(SYSTEMS)})")
    stream_on = {w for w in args.stream_workloads.split(",") if w}
    peer_on = {w for w in args.peer_workloads.split(",") if w}
    workloads = []
    for spec in args.workloads.split(","):
        name, agents, *rounds = spec.split(":")
        workloads.append((name, int(agents), int(rounds[0]) if rounds else args.rounds))
    redis_srv = (RedisServer().start() if any(s.startswith("distributed") for s in systems)
                 else None)
    fleet: list[Any] = []
    runs: list[dict[str, Any]] = []
    try:
        if args.client_cpus:
            os.sched_setaffinity(0, {int(c) for c in args.client_cpus.split(",")})
        server_cpus = (tuple(int(c) for c in args.server_cpus.split(","))
                       if args.server_cpus else None)
        # --server-defaults: llama.cpp's own slot selection and context size (``-c 0``: the
        # model's, given after LlamaServer's ``-c``, so it wins); --metrics etc. stay on
        pool = _pool_servers(args, LlamaServer) if args.pool > 1 else []
        first: dict[str, Any] = ({"cpus": (_pool_cpus(args)[0],),
                                  "ctx_per_slot": args.ctx_per_slot} if pool
                                 else {"cpus": server_cpus})
        with contextlib.ExitStack() as stack, LlamaServer(
                parallel=args.parallel, threads=args.threads,
                slot_selection=not args.server_defaults, **first,
                extra_args=_server_args(args)) as server:
            for extra in pool:  # ``--pool N``: N-1 more servers, ``server`` is the first
                stack.enter_context(extra)
            ctx: dict[str, Any] = {"http_url": server.http_url, "llamacpp_url": server.llamacpp_url,
                                   "max_tokens": args.max_tokens, "timeout": args.timeout,
                                   "peer_timeout": args.peer_timeout, "run": 0}
            if pool:
                ctx["http_urls"] = [server.http_url, *(s.http_url for s in pool)]
                ctx["llamacpp_url"] = [server.llamacpp_url, *(s.llamacpp_url for s in pool)]
            if redis_srv is not None:
                env = {"AGENTBATCH_WORKER_IMPORTS": WORKER_IMPORTS}
                fleet = [WorkerProcess(redis_srv.url, queues=q, concurrency=c, name=f"e{i}",
                                       env=env).start(wait=False)
                         for i, (q, c) in enumerate([("inference", 40), ("inference", 40),
                                                     ("tools", 16)])]
                for p in fleet:
                    p.wait_ready()
                ctx["redis_url"] = redis_srv.url
                ctx["fleet_pids"] = [p.proc.pid for p in fleet]
            for workload, n, rounds in workloads:
                # Untimed: one request per slot, at once (so each lands on its own slot), fills
                # every slot with this workload's system prompt. Otherwise the first system of
                # the first round alone pays that prefill (measured: 2028 prompt tokens computed
                # vs 730 for the systems after it, 39 s vs 22-26 s on 40 agents).
                if not pool:  # (``--pool``: skipped, see ``pool_report``)
                    await run_naive(ctx, workload, args.parallel)
                for rnd in range(rounds):
                    for system in rotated(systems, rnd):
                        if rnd >= getattr(args, "system_rounds_map", {}).get(system, rounds):
                            continue  # ``--system-rounds``: this system takes fewer rounds
                        if system == "batch_agent" and (
                                rnd >= args.peer_rounds
                                or not {workload, f"{workload}:{n}"} & peer_on):
                            continue
                        if system in STREAMED and not {workload, f"{workload}:{n}"} & stream_on:
                            continue
                        if system in STRUCTURED_ONLY and workload not in STRUCTURED_WORKLOADS:
                            continue
                        ctx["run"] += 1
                        row = await one_run(ctx, system, workload, n)
                        row["round"] = rnd
                        runs.append(row)
                        save(runs, server.command())
            server_cmd = server.command()
            if pool:
                server_cmd = [server_cmd, *(s.command() for s in pool)]
    finally:
        for p in fleet:
            p.stop(timeout=30)
        if redis_srv is not None:
            redis_srv.cleanup()
    return {"runs": runs, "server_command": server_cmd}


def _pool_servers(args: argparse.Namespace, server_cls: Any) -> list[Any]:
    """The pool's servers after the first (``--pool N``), each pinned to its own CPU
    (``--server-cpus`` lists one per server, default 0, 1, ... wrapping over the machine's),
    with its own ``-t`` threads and ``--parallel`` slots; the first server is the usual one."""
    cpus = _pool_cpus(args)
    return [server_cls(parallel=args.parallel, threads=args.threads,
                       slot_selection=not args.server_defaults, cpus=(cpus[i],),
                       ctx_per_slot=args.ctx_per_slot, extra_args=_server_args(args))
            for i in range(1, args.pool)]


def _server_args(args: argparse.Namespace) -> tuple[str, ...]:
    """Flags added to every llama-server's command: ``--server-defaults``' ``-c 0`` (given
    after LlamaServer's ``-c``, so it wins), then ``--server-args`` as written."""
    return (("-c", "0") if args.server_defaults else ()) + tuple(shlex.split(args.server_args))


def _pool_cpus(args: argparse.Namespace) -> list[int]:
    if args.server_cpus:
        return [int(c) for c in args.server_cpus.split(",")]
    n = os.cpu_count() or 1
    return [i % n for i in range(args.pool)]


def pool_report(runs: list[dict[str, Any]], args: argparse.Namespace,
                load_at_start: tuple[float, float, float]) -> dict[str, Any]:
    """``--pool``: the issue 26 ratios (long conversation, agentbatch embedded against the
    naive clients; ratios of the medians over the rounds) and what the pool was."""
    summary = summarise(runs)
    long = next((v for k, v in summary.items() if k.startswith("longconv_")), {})
    emb = long.get("embedded", {})
    return {
        "benchmark": "engine_pool",
        # No untimed warm-up run: on the long conversation it cost minutes on this loaded
        # machine; agentbatch warms every server at submit as always, the naive clients do not,
        # and the first system of round 0 meets servers with nothing cached.
        "warm_up": "none (the starting system rotates each round)",
        "pool": {"servers": args.pool, "threads_per_server": args.threads,
                 "server_cpus": _pool_cpus(args), "parallel_slots_per_server": args.parallel,
                 "ctx_per_slot": args.ctx_per_slot,
                 "long_conversation": {"pages": PAGES, "page_chars": len(page_text(1)),
                                       "max_turns": MAX_TURNS_L},
                 "loadavg_at_start": load_at_start, "loadavg_at_end": os.getloadavg()},
        "ratios_caveat": pool_caveat(runs, args.timeout),
        "ratios": {
            "embedded_wall_over_naive_round_robin": emb.get("wall_ratio_to_naive_round_robin"),
            "embedded_prompt_tokens_over_naive_round_robin": emb.get(
                "prompt_tokens_ratio_to_naive_round_robin"),
            "embedded_wall_over_naive_hash": emb.get("wall_ratio_to_naive_hash"),
        },
    }


def pool_caveat(runs: list[dict[str, Any]], timeout: float) -> str | None:
    """What the ratios mean when a run was cut off (its wall and prompt tokens stop at the
    cut-off, so a ratio to a cut-off system is an upper bound on the wall and says nothing
    firm on prompt tokens); None when every run finished."""
    long = [r for r in runs if r["workload"] == "longconv"]
    cut = sorted({r["system"] for r in long if r.get("timed_out")})
    if not cut:
        return None
    counts = ", ".join(
        f"{name} in {sum(1 for r in long if r['system'] == name and r.get('timed_out'))} of "
        f"{sum(1 for r in long if r['system'] == name)} runs" for name in cut)
    return (f"Cut off at {timeout:g} s: {counts}. A cut-off run's wall and prompt tokens are "
            "what it reached by then: a wall ratio to it is an upper bound, and a prompt-token "
            "ratio to it overstates agentbatch's share (the rest of its turns were never sent).")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--stream-workloads", default="structured",
                   help="workloads (name or name:agents) the streamed systems (TTFT) run on")
    p.add_argument("--workloads", default="structured:40:3,tools:40:2",
                   help="comma-separated name:agents[:rounds] (structured, tools)")
    p.add_argument("--peer-rounds", type=int, default=1,
                   help="rounds batch-agent takes part in (it sends no max_tokens: slow)")
    p.add_argument("--peer-workloads", default="structured:40,tools:40",
                   help="workloads (name or name:agents) batch-agent runs on")
    p.add_argument("--peer-timeout", type=float, default=60.0,
                   help="batch-agent run cut-off, seconds")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--parallel", type=int, default=4, help="llama-server slots")
    p.add_argument("--threads", type=int, default=None,
                   help="llama-server -t (default: half the CPUs)")
    p.add_argument("--server-defaults", action="store_true",
                   help="start llama-server with its own slot selection (by prompt "
                        "similarity), not agentbatch's --slot-prompt-similarity 0")
    p.add_argument("--server-args", default="",
                   help='more llama-server flags, for every server (e.g. "--cache-ram 0")')
    p.add_argument("--server-cpus", default="", help="pin llama-server to these CPUs (0,1)")
    p.add_argument("--client-cpus", default="", help="pin this process to these CPUs")
    p.add_argument("--pool", type=int, default=0,
                   help="issue 26 pool mode: start this many llama-servers (each pinned to "
                        "its own CPU, one per --server-cpus entry) and pass backend=[urls]; "
                        "default systems " + ",".join(POOL_DEFAULT_SYSTEMS))
    p.add_argument("--ctx-per-slot", type=int, default=4096,
                   help="context per slot with --pool (the long conversation needs ~3k)")
    p.add_argument("--system-rounds", default="",
                   help="comma-separated system:rounds, for systems that take fewer rounds "
                        "than their workload's (the slow ones, to fit a time budget)")
    p.add_argument("--timeout", type=float, default=240.0, help="per run, seconds")
    p.add_argument("--json", default="benchmarks/results/engine.json")
    args = p.parse_args(argv)
    args.system_rounds_map = {k: int(v) for k, v in
                              (x.split(":") for x in args.system_rounds.split(",") if x)}
    if args.pool > 1 and args.systems == ",".join(SYSTEMS):
        args.systems = ",".join(POOL_DEFAULT_SYSTEMS)
    # SIGTERM as SystemExit, so the ``finally`` blocks stop the workers and redis-server.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.perf_counter()
    load_at_start = os.getloadavg()  # the machine is shared: say how busy it was

    def report(runs: list[dict[str, Any]], server_cmd: list[str], complete: bool
               ) -> dict[str, Any]:
        return {
            "benchmark": "engine",
            "complete": complete,
            "when": utc_now(),
            "created": utc_now(),
            "machine": machine_info(),
            "command": "python -m benchmarks.bench_engine " + " ".join(sys.argv[1:] if argv is None
                                                                       else argv),
            "engine": {"server_command": server_cmd, "model": "SmolLM2-135M-Instruct Q4_1"},
            "settings": {"rounds": args.rounds, "max_tokens": args.max_tokens,
                         "temperature": 0.0, "parallel_slots": args.parallel,
                         "tool_s": TOOL_S, "distinct_tool_keys": len(ITEMS),
                         "distributed_fleet": "2 inference workers (40 threads) + 1 tool worker",
                         "naive_client": "openai.AsyncOpenAI (defaults: 2 retries)",
                         "batch_agent": "vllm:// backend, max_retries=1, defaults otherwise",
                         "batch_agent_rounds": args.peer_rounds,
                         "agentbatch_tools_max_tool_calls_per_turn": MAX_CALLS_B,
                         "agentbatch_llamacpp_compact_json": True,
                         "server_defaults": args.server_defaults,
                         "server_args": args.server_args or None,
                         "naive_hash_pinning": "agent i on server i mod N (pinned_server)",
                         "server_cpus": args.server_cpus or None,
                         "client_cpus": args.client_cpus or None,
                         "loadavg_at_start": load_at_start,
                         "batch_agent_cutoff_s": args.peer_timeout},
            "total_s": round(time.perf_counter() - started, 1),
            "summary": summarise(runs),
            "runs": runs,
        } | (pool_report(runs, args, load_at_start) if args.pool > 1 else {})

    out = asyncio.run(amain(args, lambda runs, cmd: write_json(Path(args.json),
                                                               report(runs, cmd, False))))
    final = report(out["runs"], out["server_command"], True)
    write_json(Path(args.json), final)
    print(json.dumps(final["summary"], indent=1))
    return 0


if __name__ == "__main__":
    # Through the package name, so the tool's import path is one the workers can import.
    from benchmarks.bench_engine import main as _main

    sys.exit(_main())
