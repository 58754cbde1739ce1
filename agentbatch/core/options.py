"""What a caller can set on a batch: every option declared once, here.

``BatchOptions`` is the single source of each option's name, type, default and doc. The four
public batch functions take its fields as their parameters (``api.py``), ``help()`` shows the
docs below, and the plan copies the fields a worker needs (``plan.py``). Layering: defaults <
environment (``with_environment``) < the call.
"""

from __future__ import annotations

import os
import textwrap
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field, fields, replace
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel

from agentbatch.core.errors import BatchSpecError
from agentbatch.core.results import AgentResult
from agentbatch.core.tool import Tool
from agentbatch.core.tool_output_cap import DEFAULT_MAX_TOOL_OUTPUT_CHARS

DEFAULT_MAX_INFLIGHT = 256
# Tool calls run from one model reply; the rest are answered with an error, so one runaway
# reply cannot flood the tool queue.
DEFAULT_MAX_TOOL_CALLS_PER_TURN = 32

ToolCalling = Literal["native", "json", "auto"]
ToolChoice = Literal["auto", "required"]
Compaction = Literal["truncate", "summarize"]
Pricing = Literal["sync", "batch", "auto"]
PoolRouting = Literal["affinity", "least_outstanding"]
# A pool's home endpoint takes an agent's turn until it holds more than this many times the
# mean number of requests in flight (backends/affinity.load_bound).
DEFAULT_POOL_LOAD_FACTOR = 1.25


def _doc(text: str) -> dict[str, str]:
    """A field's docstring, where ``help()`` and the generated ``Args`` section read it."""
    return {"doc": text}


@dataclass
class BatchOptions:
    """The parameters of ``run_batch``, ``submit_batch`` and their async forms."""

    task: str = field(metadata=_doc("a ``str.format`` template rendered with each input dict."))
    inputs: Iterable[Mapping[str, Any] | BaseModel] = field(metadata=_doc(
        "one dict (or Pydantic model) per agent; keys are strings, values plain JSON."))
    _: KW_ONLY
    system_prompt: str | None = field(default=None, metadata=_doc(
        "shared by every agent (part of the cached prefix)."))
    tools: Sequence[Tool | str] | Tool | str | None = field(default=(), metadata=_doc(
        '``@tool`` functions (defined at module level) or "module:attr" import paths.'))
    output_schema: type[BaseModel] | None = field(default=None, metadata=_doc(
        "a Pydantic model class the final answer must validate against; None for free text."))
    model: str | None = field(default=None, metadata=_doc(
        "model name sent to the backend (env ``AGENTBATCH_MODEL``)."))
    backend: str | Sequence[str] | None = field(default=None, metadata=_doc(
        "URL such as ``vllm://gpu-0:8000``, or a list of URLs (env ``AGENTBATCH_BACKEND``)."))
    max_turns: int = field(default=6, metadata=_doc(
        "model turns an agent may take (repair turns not counted); >= 1."))
    max_retries: int = field(default=2, metadata=_doc(
        "per agent, retries of failed model calls plus repair turns; >= 0."))
    max_inflight: int | None = field(default=None, metadata=_doc(
        "inference requests in flight at once (default: the backend's safe cap)."))
    max_tool_calls_per_turn: int = field(default=DEFAULT_MAX_TOOL_CALLS_PER_TURN, metadata=_doc(
        "tool calls run from one model reply; each call past it is answered with an error "
        "the model can read, and not run. >= 1."))
    max_tool_output_chars: int = field(default=DEFAULT_MAX_TOOL_OUTPUT_CHARS, metadata=_doc(
        "a tool's output (or error) longer than this is cut to it, the cut marked "
        "``[... truncated N of M chars by agentbatch]`` for the model, before it is stored or "
        "sent; a tool's own ``max_output_chars`` overrides it. >= 1."))
    max_context_tokens: int | None = field(default=None, metadata=_doc(
        "the model's context length in tokens; None: learnt from the server (vLLM's "
        "``/v1/models`` ``max_model_len``, llama.cpp's ``/props`` ``n_ctx``), and unchecked "
        "where the server does not say. A turn whose prompt plus ``max_tokens`` would not fit "
        "is never sent: compaction runs first, else the agent ends ``context_overflow``. >= 1."))
    compaction: Compaction | None = field(default=None, metadata=_doc(
        'what to do once a prompt passes ``compaction_threshold`` of the context. '
        '``"truncate"``: cut tool outputs, oldest first, each with a marker saying what was '
        'removed. ``"summarize"``: replace older turns with a summary made by a model call. '
        "None: nothing (a prompt that does not fit ends the agent). The stored conversation "
        "is never rewritten: compaction is applied to the prompt as it is built, after the "
        "byte-identical shared prefix."))
    compaction_threshold: float = field(default=0.8, metadata=_doc(
        "the fraction of the context, in (0, 1], past which compaction starts."))
    timeout_per_turn: float | None = field(default=120.0, metadata=_doc(
        "seconds for one model call attempt (finite, > 0; None: no limit)."))
    timeout_per_tool: float | None = field(default=60.0, metadata=_doc(
        "seconds for one tool call (finite, > 0; None: no limit)."))
    max_tokens: int | None = field(default=None, metadata=_doc(
        "completion token cap per model call (>= 1; None: server default)."))
    temperature: float | None = field(default=None, metadata=_doc(
        "sampling temperature (finite, >= 0; None: server default)."))
    prices: Mapping[str, Mapping[str, float]] | str | os.PathLike[str] | None = field(
        default=None, metadata=_doc(
            "model name -> USD per million tokens: ``prompt``, ``cached_prompt``, "
            "``completion`` and the same with a ``batch_`` prefix (provider batch APIs), or "
            "the path of a YAML or JSON file holding that (env ``AGENTBATCH_PRICES``). With "
            "it every result carries ``cost_usd`` and ``progress()`` the spend so far; the "
            "batch's model must be in it, prices finite and >= 0 (core/pricing.py)."))
    max_cost_usd: float | None = field(default=None, metadata=_doc(
        "a cap on the batch's spend at ``prices`` (US dollars, finite, >= 0). Once reached no "
        "new turn starts; turns already sent finish, and every agent that needed another "
        "turn ends ``budget_exceeded``. ``progress()`` warns (``budget_warning``, and a log "
        "line) once the projection passes it (docs/cost.md). On the distributed engine it "
        "holds fleet-wide: the spend is kept in Redis, added with each commit."))
    max_agent_cost_usd: float | None = field(default=None, metadata=_doc(
        "a cap on one agent's spend at ``prices`` (US dollars, finite, >= 0): an agent that "
        "has reached it starts no new turn and ends ``budget_exceeded``; on both engines."))
    pricing: Pricing = field(default="sync", metadata=_doc(
        '``"sync"``: every turn through the normal API. ``"batch"``: every turn through the '
        "provider's batch API (half price, minutes of latency; the backend must have one, "
        'found at warm-up). ``"auto"``: the batch API while each agent\'s projected finish '
        "stays inside ``deadline``, the sync API for the turns that would miss it; turns "
        "waiting past the observed p90 batch latency are hedged to the sync API "
        '(docs/cost.md). Both engines; on the distributed engine each worker routes and hedges '
        "on the latencies it has observed itself."))
    deadline: datetime | float | None = field(default=None, metadata=_doc(
        "when the batch must finish: an aware datetime, or seconds from submit (finite, "
        '> 0). Required by ``pricing="auto"``; with ``"batch"`` it bounds the wait on a '
        "provider batch (a failed or expired one falls back to the sync API only while the "
        'deadline allows). Not taken with ``pricing="sync"``. On the distributed engine it '
        "becomes one instant in Redis's clock at submit (the workers' clock)."))
    hedge_after: float | None = field(default=None, metadata=_doc(
        "with a pool of >= 2 endpoints (``backend=[url, url, ...]``): a model turn in flight "
        "longer than this multiple of the running p95 turn latency (finite, > 1) is sent "
        "again to another endpoint; the first answer is used, the other request cancelled, "
        "and the turn applied once. The p95 is the typical endpoint's (the median over "
        "endpoints of each one's p95 over its last 200 answers), known once an endpoint has "
        "answered 20 turns. Counters: embedded, ``handle.stats()['pool']['hedge']``; "
        "distributed, each worker hedges the turns it runs (its own p95s), counted on the "
        "batch as ``stat:hedges``, ``stat:hedge_wins``... in ``handle.status()`` "
        "(docs/backends.md)."))
    pool_routing: PoolRouting = field(default="affinity", metadata=_doc(
        'with a pool of >= 2 endpoints (``backend=[url, url, ...]``), where each model turn '
        'goes. ``"affinity"``: to its agent\'s home endpoint, the one that served its last '
        "turn (kept in the agent's state, so the same in every process), which holds its "
        "conversation in its prefix cache; a first turn, with no home yet, to the endpoint "
        "with the fewest requests in flight (ties by rendezvous hashing of the agent's key). "
        "A turn moves to the agent's next choice only when the home is ejected, has just "
        'failed, or is past ``pool_load_factor`` (each move counted). ``"least_outstanding"``: '
        "to the endpoint with the fewest requests in flight, ties in turn, with no regard to "
        "the agent. "
        '``"least_outstanding"`` on one endpoint is refused (docs/backends.md).'))
    pool_load_factor: float = field(default=DEFAULT_POOL_LOAD_FACTOR, metadata=_doc(
        'with ``pool_routing="affinity"`` on a pool: an agent\'s turn leaves its home endpoint '
        "when the home already holds this times the pool's mean number of requests in "
        "flight (the turn being routed counted; at least 2). Lower spreads load sooner, "
        "higher keeps caches warmer. Finite, >= 1; another value than the default is refused "
        'on one endpoint and with ``"least_outstanding"``.'))
    keep_transcript: bool = field(default=False, metadata=_doc(
        "put each agent's whole conversation (messages, tool calls, tool outputs) on "
        "``AgentResult.messages``; the distributed engine keeps it in Redis for the batch's "
        "retention (``agentbatch show``). A failed agent's is always kept. Memory: about "
        "the size of every prompt's new part, per agent (docs/transcripts.md)."))
    on_result: Callable[[AgentResult], object] | None = field(default=None, metadata=_doc(
        "called with each result as it arrives; exceptions are logged, never raised."))
    progress: bool | None = field(default=None, metadata=_doc(
        "``run_batch`` shows a live progress bar on stderr (rich; tqdm's notebook bar in "
        "Jupyter when tqdm is installed): done, failed by kind, running, awaiting tools, "
        "throughput, ETA, engine. None: on when stderr is a terminal or in Jupyter, and the "
        "``CI`` environment variable is unset. Submitter-side only: not sent to workers."))
    metrics_port: int | None = field(default=None, metadata=_doc(
        "the embedded engine serves Prometheus metrics (``agentbatch_*``, the names a worker "
        "exports; docs/metrics.md) at ``http://127.0.0.1:PORT/metrics`` for the rest of the "
        "process (env ``AGENTBATCH_METRICS_HOST`` for another interface). A port in use is "
        "refused, naming it. Submitter-side only: refused with redis_url, where each worker "
        "exports its own (``agentbatch worker --metrics-port``)."))
    redis_url: str | None = field(default=None, metadata=_doc(
        "selects the distributed engine (env ``AGENTBATCH_REDIS_URL``)."))
    batch_id: str | None = field(default=None, metadata=_doc(
        "a caller-chosen id (default: random)."))
    checkpoint_dir: str | os.PathLike[str] | None = field(default=None, metadata=_doc(
        "a directory where the embedded engine keeps a SQLite checkpoint (WAL) of every "
        "agent after each committed turn and tool round. Run the same batch again with it "
        "after a crash: finished agents come back from it without a model call, unfinished "
        "ones continue from their last committed turn (docs/checkpoints.md). Refused with "
        "redis_url: the distributed engine keeps its state in Redis."))
    retry_failed: bool = field(default=True, metadata=_doc(
        "with checkpoint_dir: agents that ended in failure in an earlier run start over "
        "(False: their stored failures are returned as they were)."))
    native_json_schema: bool = field(default=True, metadata=_doc(
        "also send the schema as ``response_format`` where it can apply."))
    warm_prefix: bool = field(default=True, metadata=_doc(
        "send the shared prefix once before the fan-out, where the server needs it (not "
        "vLLM, which shares a prefix among requests in flight: there it checks the server "
        "answers)."))
    batch_prompting: bool = field(default=False, metadata=_doc(
        "gather concurrent tool-free turns into one ``/v1/completions`` request with a prompt "
        "list (rendered with the server's chat template on llama.cpp and vLLM, ChatML "
        "elsewhere)."))
    max_server_waiting: int | None = field(default=None, metadata=_doc(
        "hold new model calls while the server's ``/metrics`` shows more waiting requests "
        "than this (backpressure; >= 0; None: off)."))
    tool_calling: ToolCalling = field(default="native", metadata=_doc(
        'how the model calls tools. ``"native"``: the server\'s tool-call API. ``"json"``: '
        "each turn is constrained by guided JSON to "
        '``{"tool_calls": [{"name", "arguments"}, ...]}`` or ``{"final": <answer>}`` (no '
        "native tools sent; for servers or templates without reliable tool calls). "
        '``"auto"``: json when a backend cannot force a native tool call (llama.cpp).'))
    tool_choice: ToolChoice = field(default="auto", metadata=_doc(
        '``"auto"``: the model decides each turn. ``"required"``: an agent must call a tool '
        "before its final answer (every turn until its first tool results is a tool call; "
        "``required_tool_rounds`` for more rounds). "
        "In json mode the turn's schema allows only tool calls; in native mode a backend "
        "that does not enforce it is refused."))
    required_tool_rounds: int = field(default=1, metadata=_doc(
        'with ``tool_choice="required"``: the tool rounds (replies whose tool calls ran) an '
        "agent must take before it may answer; until then every turn of it, repair turns "
        "included, must be a tool call. >= 1 and < ``max_turns``; another value than 1 is "
        'refused with ``tool_choice="auto"``.'))


def args_doc() -> str:
    """The ``Args:`` section of the batch functions' docs, from the field docs."""
    return "Args:\n" + "\n".join(
        textwrap.fill(f"{f.name}: {f.metadata['doc']}", 92, initial_indent="    ",
                      subsequent_indent="        ") for f in fields(BatchOptions))


def with_environment(opts: BatchOptions) -> BatchOptions:
    """``opts`` with what the call left out filled from the environment; model and backend
    are required from one or the other."""
    model = opts.model or os.environ.get("AGENTBATCH_MODEL")
    backend = opts.backend or os.environ.get("AGENTBATCH_BACKEND")
    if not model:
        raise BatchSpecError("model is required (or set AGENTBATCH_MODEL)")
    if not backend:
        raise BatchSpecError("backend is required, e.g. 'vllm://host:8000' (or AGENTBATCH_BACKEND)")
    return replace(opts, model=model, backend=backend, tools=opts.tools or (),
                   redis_url=opts.redis_url or os.environ.get("AGENTBATCH_REDIS_URL"),
                   prices=opts.prices if opts.prices is not None
                   else os.environ.get("AGENTBATCH_PRICES") or None)


BatchOptions.__doc__ = f"{BatchOptions.__doc__}\n\n{args_doc()}"
