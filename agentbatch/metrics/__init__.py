"""agentbatch's Prometheus metrics (``agentbatch_*``): every metric declared once, here.

Both engines record through the functions below, at the single place each thing happens: a
model call (``turnloop/turn_io.call_model``), a tool call (``ToolPool._bump``), an agent's
end (the embedded engine's ``_drive``, the worker's ``commit``), a worker event
(``WorkerContext.stats``), a hedge of ``hedge_after=`` (``backends/hedge.Hedger``), a turn a
pool moved off its agent's home endpoint (``backends/pool_moves.py``). The names are listed
in docs/metrics.md and used by deploy/grafana-agentbatch.json.

The metric objects are made on first use, not at import: under Celery's prefork pool the
worker sets ``PROMETHEUS_MULTIPROC_DIR`` (``metrics.server.enable_multiprocess``) before any
of them exists, so each forked child writes its values to files the metrics server sums.
"""

from __future__ import annotations

import threading
import time
from collections import Counter as _Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from agentbatch.core.agent_state import AgentState
    from agentbatch.core.model_io import ModelResponse

# Seconds: model calls last from ~10 ms (a small local model) to minutes (a long completion).
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# ToolPool's counters (toolpool/pool.py ``_COUNTERS``) -> (metric, extra labels).
_TOOL_COUNTERS = {
    "calls": ("tool_calls", {}),
    "executions": ("tool_executions", {}),
    "cache_hits": ("tool_shared", {"how": "cached"}),
    "coalesced": ("tool_shared", {"how": "coalesced"}),
    "errors": ("tool_errors", {}),
    "timeouts": ("tool_timeouts", {}),
}


@dataclass(frozen=True)
class Metrics:
    registry: CollectorRegistry
    turns: Counter
    agents_finished: Counter
    tokens: Counter
    model_latency: Histogram
    model_ttft: Histogram
    model_inflight: Gauge
    tool_calls: Counter
    tool_executions: Counter
    tool_shared: Counter
    tool_errors: Counter
    tool_timeouts: Counter
    events: Counter
    hedges: Counter
    hedge_outcomes: Counter
    hedge_loser_tokens: Counter
    pool_moves: Counter


_lock = threading.Lock()
_metrics: Metrics | None = None
# (metric, label values) -> its child. ``labels()`` sorts, validates and locks on every call,
# about as much CPU as the rest of a turn's bookkeeping: the hot paths look children up here.
_children: dict[tuple[Any, tuple[str, ...]], Any] = {}
# (tool_calls metric, tool): every tool counter's child made (``record_tool``), as bounded as
# ``_children`` (ToolPool counts unknown tool names under one name)
_tools_made: set[tuple[Any, str]] = set()


def created() -> bool:
    """Whether the metric objects exist yet (multiprocess mode must be chosen before)."""
    return _metrics is not None


def metrics() -> Metrics:
    """The metric objects of this process, made on first use (see the module doc)."""
    global _metrics
    if _metrics is None:
        with _lock:
            if _metrics is None:
                _metrics = _declare()
    return _metrics


def _declare() -> Metrics:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    reg = CollectorRegistry(auto_describe=True)
    return Metrics(
        registry=reg,
        turns=Counter("agentbatch_turns", "Model calls, by outcome (replied, failed) and "
                      "error kind (empty when replied).", ["outcome", "error_kind"],
                      registry=reg),
        agents_finished=Counter("agentbatch_agents_finished", "Agents that ended, by status "
                                "(done, failed, cancelled) and error kind.",
                                ["status", "error_kind"], registry=reg),
        tokens=Counter("agentbatch_tokens", "Tokens of model calls, by kind (prompt, cached: "
                       "the part of the prompt served from a prefix cache, completion).",
                       ["kind"], registry=reg),
        model_latency=Histogram("agentbatch_model_latency_seconds", "Seconds per model call "
                                "(retries included), by backend.", ["backend"],
                                buckets=LATENCY_BUCKETS, registry=reg),
        model_ttft=Histogram("agentbatch_model_ttft_seconds", "Time to first token of "
                             "streamed model calls, by backend.", ["backend"],
                             buckets=TTFT_BUCKETS, registry=reg),
        model_inflight=Gauge("agentbatch_model_inflight", "Model calls in flight, by backend.",
                             ["backend"], multiprocess_mode="livesum", registry=reg),
        tool_calls=Counter("agentbatch_tool_calls", "Tool calls made by agents, by tool.",
                           ["tool"], registry=reg),
        tool_executions=Counter("agentbatch_tool_executions", "Tool calls that ran the tool "
                                "function, by tool.", ["tool"], registry=reg),
        tool_shared=Counter("agentbatch_tool_shared", "Tool calls answered without running: "
                            "from the cache (how=cached) or another call's run "
                            "(how=coalesced), by tool.", ["tool", "how"], registry=reg),
        tool_errors=Counter("agentbatch_tool_errors", "Tool calls that ended in an error, by "
                            "tool.", ["tool"], registry=reg),
        tool_timeouts=Counter("agentbatch_tool_timeouts", "Tool calls that timed out, by tool.",
                              ["tool"], registry=reg),
        events=Counter("agentbatch_events", "Worker events (dropped duplicates, recoveries, "
                       "...), by kind.", ["event"], registry=reg),
        hedges=Counter("agentbatch_hedges", "Model turns sent a second time, to another "
                       "endpoint of a pool, past the hedge_after bar.", registry=reg),
        hedge_outcomes=Counter("agentbatch_hedge_outcomes", "Hedged turns settled, by outcome "
                               "(hedge_won, original_won, both_failed).", ["outcome"],
                               registry=reg),
        hedge_loser_tokens=Counter("agentbatch_hedge_loser_tokens", "Tokens of the losing "
                                   "request of hedged turns, by kind (prompt, completion): "
                                   "what hedging cost beyond the turns' own tokens.",
                                   ["kind"], registry=reg),
        pool_moves=Counter("agentbatch_pool_moves", "Model turns a pool routed off their "
                           "agent's home endpoint, by reason (load: the home was past its "
                           "bound; failover: it was ejected or had just failed).", ["reason"],
                           registry=reg),
    )


def _child(metric: Any, *values: str) -> Any:
    """``metric.labels(*values)``, made once per process (the same object prometheus keeps)."""
    key = (metric, values)
    child = _children.get(key)
    if child is None:
        child = _children[key] = metric.labels(*values)
    return child


# --- recording: one call at each place where it happens -----------------------------------


class _BackendSeries:
    """One backend's model-call series (and the reply counters every backend shares), each
    looked up once per backend and process: ``_child``'s key and dict lookup, seven times a
    turn, cost more than the increments themselves (issue 26 item 5). Each child is the very
    object ``metric.labels(...)`` returns, made at the moment it was made before (in flight
    on entering a call, latency on leaving it, the turn and token counters at the first
    reply, time to first token at the first reply that has one), so the series exposed, and
    when they appear, are unchanged."""

    __slots__ = ("_inflight", "_latency", "_reply", "_ttft", "backend", "metrics")

    def __init__(self, m: Metrics, backend: str) -> None:
        self.metrics = m
        self.backend = backend
        self._inflight: Any = None
        self._latency: Any = None
        self._reply: tuple[Any, Any, Any, Any] | None = None
        self._ttft: Any = None

    def inflight(self) -> Any:
        child = self._inflight
        if child is None:
            child = self._inflight = _child(self.metrics.model_inflight, self.backend)
        return child

    def latency(self) -> Any:
        child = self._latency
        if child is None:
            child = self._latency = _child(self.metrics.model_latency, self.backend)
        return child

    def reply(self) -> tuple[Any, Any, Any, Any]:
        """(turns replied, tokens prompt, cached, completion)."""
        children = self._reply
        if children is None:
            m = self.metrics
            children = self._reply = (_child(m.turns, "replied", ""), _child(m.tokens, "prompt"),
                                      _child(m.tokens, "cached"), _child(m.tokens, "completion"))
        return children

    def ttft(self) -> Any:
        child = self._ttft
        if child is None:
            child = self._ttft = _child(self.metrics.model_ttft, self.backend)
        return child


# backend name -> its series (bounded like ``_children``: one entry per backend of a batch)
_backends: dict[str, _BackendSeries] = {}


def _backend(backend: str) -> _BackendSeries:
    series = _backends.get(backend)
    if series is None or series.metrics is not _metrics:
        series = _backends[backend] = _BackendSeries(metrics(), backend)
    return series


def model_call(backend: str) -> _ModelCall:
    """``with model_call(backend):`` around one model call: in flight while it runs, its
    latency, and a failure's kind (an ``Exception``; a cancellation is not a failure)."""
    return _ModelCall(backend)


class _ModelCall:
    """``model_call``'s context manager, a plain class: a generator one cost more on every
    turn (issue 26 item 5)."""

    __slots__ = ("_backend", "_series", "_start")

    def __init__(self, backend: str) -> None:
        self._backend = backend

    def __enter__(self) -> None:
        self._series = series = _backend(self._backend)
        series.inflight().inc()
        self._start = time.monotonic()

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        series = self._series
        try:
            if isinstance(exc, Exception):
                kind = str(getattr(exc, "kind", "internal"))
                _child(series.metrics.turns, "failed", kind).inc()
        finally:
            series.inflight().dec()
            series.latency().observe(time.monotonic() - self._start)


def record_reply(backend: str, response: ModelResponse) -> None:
    """A model call that replied: one turn, its tokens and its time to first token."""
    series = _backend(backend)
    replied, prompt, cached, completion = series.reply()  # token series exist from here, at 0
    replied.inc()
    usage = response.usage
    if usage.prompt_tokens > 0:
        prompt.inc(usage.prompt_tokens)
    if usage.cached_tokens > 0:
        cached.inc(usage.cached_tokens)
    if usage.completion_tokens > 0:
        completion.inc(usage.completion_tokens)
    if response.ttft_s is not None:
        series.ttft().observe(response.ttft_s)


def record_agent_end(state: AgentState) -> None:
    """An agent reached a terminal state (counted by the engine that committed it)."""
    kind = state.error.kind if state.error is not None else ""
    _child(metrics().agents_finished, state.status.value, kind).inc()


def record_tool(tool: str, counter: str, n: int = 1) -> None:
    """One of ToolPool's per-tool counters moved (``calls``, ``executions``, ...)."""
    child = _tool_children.get((tool, counter))
    if child is None:
        child = _tool_child(tool, counter)
        if child is None:
            return
    child.inc(n)


# (tool, counter) -> the child ``record_tool`` increments, once ``_tool_child`` made it: two
# or three tool counters move on every tool call (issue 26 item 5). As bounded as
# ``_children``; an entry for ``calls`` exists only once the tool's every series was made.
_tool_children: dict[tuple[str, str], Any] = {}


def _tool_child(tool: str, counter: str) -> Any:
    """``record_tool``'s first call for ``(tool, counter)``: the series it makes, the child."""
    m = metrics()
    if counter == "calls" and (m.tool_calls, tool) not in _tools_made:
        # a tool's every counter exists from its first call (at 0)
        for other, labels in _TOOL_COUNTERS.values():
            _child(getattr(m, other), tool, *labels.values())
        _tools_made.add((m.tool_calls, tool))
    name, extra = _TOOL_COUNTERS.get(counter, (None, {}))
    if name is None:
        return None
    child = _tool_children[(tool, counter)] = _child(getattr(m, name), tool, *extra.values())
    return child


HEDGE_OUTCOMES = ("hedge_won", "original_won", "both_failed")
MOVE_REASONS = ("load", "failover")
LOSER_TOKEN_KINDS = ("prompt", "completion")


def hedging_enabled() -> None:
    """A pool hedges in this process: its hedge counters exist from now on (at 0)."""
    m = metrics()
    m.hedges.inc(0)
    for outcome in HEDGE_OUTCOMES:
        _child(m.hedge_outcomes, outcome)
    for kind in LOSER_TOKEN_KINDS:
        _child(m.hedge_loser_tokens, kind)


def record_hedge_sent() -> None:
    """A turn was sent a second time (``hedge_after=``)."""
    metrics().hedges.inc()


def record_hedge_outcome(outcome: str) -> None:
    """A hedged turn settled: ``hedge_won``, ``original_won`` or ``both_failed``."""
    _child(metrics().hedge_outcomes, outcome).inc()


def record_hedge_loser_tokens(prompt: int, completion: int) -> None:
    """The tokens a hedged turn's losing request took (its prompt at least)."""
    m = metrics()
    _child(m.hedge_loser_tokens, "prompt").inc(max(prompt, 0))
    _child(m.hedge_loser_tokens, "completion").inc(max(completion, 0))


def pool_moves_enabled() -> None:
    """A pool routes in this process: its move counters exist from now on (at 0)."""
    m = metrics()
    for reason in MOVE_REASONS:
        _child(m.pool_moves, reason)


def record_pool_move(reason: str, n: int = 1) -> None:
    """A pool routed ``n`` turns off their agent's home endpoint (``load`` / ``failover``)."""
    _child(metrics().pool_moves, reason).inc(n)


class EventCounter(_Counter[str]):
    """A worker's event counts (``ctx.stats[what] += n``) that also count in
    ``agentbatch_events_total``, so the count survives prefork (a child's dict does not)."""

    def __setitem__(self, key: str, value: Any) -> None:
        delta = value - self.get(key, 0)
        super().__setitem__(key, value)
        if isinstance(delta, int | float) and delta > 0:
            metrics().events.labels(event=key).inc(delta)
