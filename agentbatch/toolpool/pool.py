"""``ToolPool``: runs the model's tool calls for every agent of a batch.

A failing tool is not a failing agent, so ``run`` turns every tool-side failure (unknown tool,
bad arguments, exception, timeout) into an ``ok=False`` outcome the model can read and react
to. Only cancellation of the caller itself propagates.

Per call: validate the arguments, then serve from the result cache (cacheable tools only), else
join or start the shared execution of identical in-flight calls. The shared execution waits
for the tool's rate limit, runs the function (sync functions in a worker thread) under the
tool's timeout, caps its output (``output_cap``: before anything caches, shares or stores
it) and caches successes. Errors are never cached.

Who may share an execution (``call_key``): calls from different agents only for tools declared
safe to share (``cacheable`` or ``coalesce``), and then only within one batch unless the tool
says ``share="fleet"``. Every other call is keyed by its own idempotency key, so only duplicate
deliveries of that same call merge; a caller that already holds such a call's lease (the
distributed engine takes it when it starts the call) runs it directly. Keys name the tool by
its identity (import path + version), never by its model-facing name. A shared execution
runs with the *leader's* ``ToolContext`` (the caller that started it), carrying the lease's
fencing token.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, cast

import pydantic_core
from pydantic import BaseModel

from agentbatch.core.errors import BatchSpecError, ToolError
from agentbatch.core.model_io import ToolCall, ToolOutcome, canonical_json
from agentbatch.core.tool import Tool, resolve_tool
from agentbatch.core.tool_context import Lease, ToolContext
from agentbatch.core.tool_output_cap import DEFAULT_MAX_TOOL_OUTPUT_CHARS, cap_output, check_limit
from agentbatch.core.tool_schema import ArgumentsInvalid, ValidatedArgs
from agentbatch.core.wait_for import wait_for
from agentbatch.metrics import record_tool
from agentbatch.toolpool.cache import ResultCache, TTLCache
from agentbatch.toolpool.coalesce import Coalescer, InflightCoalescer, Thunk
from agentbatch.toolpool.ratelimit import TokenBucket
from agentbatch.toolpool.sync_runner import run_sync

__all__ = ["ToolPool", "to_text"]

# ``asyncio.timeout`` (3.11+) bounds a call in its own task; a caller's cancel arriving with
# the result is raised, not lost (the bug ``core/wait_for.py`` works around is wait_for's).
_TIMEOUT = getattr(asyncio, "timeout", None)
log = logging.getLogger(__name__)

_UNKNOWN = "(unknown tool)"
# ``json.dumps(value, separators=(",", ":"))``'s encoder, made once: ``dumps`` builds a new one
# on every call given an argument, and ``call_key`` runs on every tool call (issue 26 item 5)
_KEY_JSON = json.JSONEncoder(separators=(",", ":"))
_COUNTERS = ("calls", "executions", "cache_hits", "coalesced", "errors", "timeouts")
# Results of share="fleet" tools, for pools given no fleet-wide cache: in one process, the
# process is the fleet (embedded batches share them as distributed workers share Redis).
_PROCESS_CACHE = TTLCache(max_entries=10_000)


class ToolPool:
    """The tools of one batch, with shared coalescing, caching, rate limits and timeouts.

    ``coalescer`` defaults to an in-process ``InflightCoalescer`` and ``cache`` to an in-process
    ``TTLCache``; pass Redis-backed implementations to share them across a worker fleet.
    ``fleet_cache`` holds the results of ``share="fleet"`` tools (default: one cache for the
    whole process). ``tools`` may also hold "module:attr" import paths (how workers rebuild
    the pool). ``bucket_factory(tool)`` builds each rate-limited tool's bucket (anything with
    ``async acquire()``; default: an in-process ``TokenBucket``). ``max_output_chars``: the
    batch's cap on a tool's output (a tool's own ``max_output_chars`` overrides it).
    """

    def __init__(
        self,
        tools: Sequence[Tool | str],
        *,
        coalescer: Coalescer | None = None,
        cache: ResultCache | None = None,
        fleet_cache: ResultCache | None = None,
        cache_ttl: float = 3600.0,
        default_timeout: float | None = None,
        bucket_factory: Callable[[Tool], Any] | None = None,
        max_output_chars: int = DEFAULT_MAX_TOOL_OUTPUT_CHARS,
    ) -> None:
        check_limit(max_output_chars, "max_tool_output_chars")
        self.max_output_chars = max_output_chars
        self._tools: dict[str, Tool] = {}
        for item in tools:
            t = resolve_tool(item)
            if t.name in self._tools:
                raise BatchSpecError(f"duplicate tool name {t.name!r}: tool names must be unique")
            self._tools[t.name] = t
        if default_timeout is not None and not default_timeout > 0:
            raise BatchSpecError("default_timeout must be positive")
        if not cache_ttl > 0:
            raise BatchSpecError("cache_ttl must be positive")
        self.default_timeout = default_timeout
        self.cache_ttl = cache_ttl
        self._coalescer: Coalescer = coalescer if coalescer is not None else InflightCoalescer()
        self._cache: ResultCache = cache if cache is not None else TTLCache(ttl=cache_ttl)
        self._fleet_cache: ResultCache = fleet_cache if fleet_cache is not None else _PROCESS_CACHE
        # rate limits: an in-process bucket per tool unless ``bucket_factory`` (distributed
        # workers: one bucket in Redis per tool, shared by the fleet) says otherwise
        # (only tools with a rate limit get a bucket: ``t.rate_limit`` is set there)
        make = bucket_factory or (lambda t: TokenBucket(cast(float, t.rate_limit)))
        self._buckets = {t.name: make(t) for t in self._tools.values() if t.rate_limit}
        self._stats: dict[str, dict[str, int]] = {}

    # -- introspection -------------------------------------------------------------------

    @property
    def tools(self) -> tuple[Tool, ...]:
        return tuple(self._tools.values())

    @property
    def coalescer(self) -> Coalescer:
        return self._coalescer

    @property
    def cache(self) -> ResultCache:
        return self._cache

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __len__(self) -> int:
        return len(self._tools)

    def schemas(self) -> list[dict[str, Any]]:
        """OpenAI tool schemas in the order the tools were given (part of the cached prefix)."""
        return [t.openai_schema() for t in self._tools.values()]

    def call_key(self, tool: Tool, args: ValidatedArgs, ctx: ToolContext) -> str:
        """The cache and coalescing key: calls with equal keys may share one execution.

        Safe-to-share tools: the same arguments from any agent of the batch (of the fleet with
        ``share="fleet"``). Any other tool: only this very call (its idempotency key).
        """
        if not tool.shares_calls:
            scope = f"call:{ctx.idempotency_key}"
        elif tool.share == "fleet":
            scope = "fleet"
        else:
            scope = f"batch:{ctx.batch_id}"
        part = args.canonical
        if tool.cache_key is not None and tool.shares_calls:
            key = tool.sharing_key(args.kwargs)
            try:
                part = "key:" + canonical_json(key)
            except (TypeError, ValueError) as exc:
                raise ToolError(f"error: tool {tool.name!r}: its cache_key returned "
                                f"{type(key).__name__}, not a JSON value ({exc})") from None
        return _KEY_JSON.encode([scope, tool.identity, part])

    def stats(self) -> dict[str, Any]:
        """Counters (totals plus ``by_tool``): calls, executions, cache_hits, coalesced, ..."""
        by_tool = {name: dict(c) for name, c in self._stats.items()}
        totals = {k: sum(c[k] for c in by_tool.values()) for k in _COUNTERS}
        return {**totals, "by_tool": by_tool}

    # -- running -------------------------------------------------------------------------

    async def run(self, call: ToolCall, ctx: ToolContext, *,
                  timeout: float | None = None) -> ToolOutcome:
        """Run one call; tool failures come back as ``ok=False`` outcomes, never exceptions."""
        tool = self._tools.get(call.name)
        if tool is None:
            # Counted under one name: invented names must not grow the stats without bound.
            self._bump(_UNKNOWN, "calls")
            self._bump(_UNKNOWN, "errors")
            names = ", ".join(self._tools) or "(none)"
            message = f"error: unknown tool {call.name!r}; available tools: {names}"
            return ToolOutcome(call_id=call.id, name=call.name, content=message, ok=False)
        self._bump(call.name, "calls")
        if call.arguments_error is not None:
            return self._error(
                call,
                f"error: the arguments for tool {call.name!r} were not valid JSON "
                f"({call.arguments_error}); send a JSON object matching the tool's parameters",
            )
        try:
            args = tool.spec.validate(call.arguments, tool_name=tool.name)
        except ArgumentsInvalid as exc:
            return self._error(call, str(exc))

        # the first given of: this call's, the tool's, the pool's (no generator on every call)
        limit = timeout if timeout is not None else (
            tool.timeout if tool.timeout is not None else self.default_timeout)
        try:
            key = self.call_key(tool, args, ctx)
        except ToolError as exc:  # the tool's cache_key raised: the call fails as data
            return self._error(call, str(exc))
        state: dict[str, bool] = {}
        try:
            if self._waits_in_coalescer(tool, ctx):
                # nothing to await before the in-process coalescer: it bounds this caller's
                # wait itself (a timer on the caller's future: no cancel, no scope per call)
                text, shared = await cast(InflightCoalescer, self._coalescer).run(
                    key, self._thunk(tool, key, args, ctx, state), lock_ttl=tool.lock_ttl,
                    timeout=limit)
                cached = state.get("cached", False) and not shared
            elif limit is None:
                text, cached, shared = await self._resolve(tool, key, args, ctx, state)
            elif _TIMEOUT is not None:  # 3.11+: the deadline on this task, no task of its own
                async with _TIMEOUT(limit):  # (wait_for made one, and a future, per call)
                    text, cached, shared = await self._resolve(tool, key, args, ctx, state)
            else:
                text, cached, shared = await wait_for(
                    self._resolve(tool, key, args, ctx, state), limit)
        except asyncio.TimeoutError:
            self._bump(tool.name, "timeouts")
            return self._error(call, _timeout_message(tool.name, limit))
        except ToolError as exc:
            if isinstance(exc, _ExecutionTimeout):
                self._bump(tool.name, "timeouts")
            return self._error(call, str(exc) or f"error: {type(exc).__name__}",
                               shared=not state.get("started", False))
        except Exception as exc:  # a cache or coalescer backend failing: still an outcome
            log.warning("tool %r: infrastructure failure", tool.name, exc_info=True)
            return self._error(call, _describe(exc))
        if cached:
            self._bump(tool.name, "cache_hits")
        if shared:
            self._bump(tool.name, "coalesced")
        return ToolOutcome(call_id=call.id, name=call.name, content=text,
                           cached=cached, coalesced=shared)

    async def run_many(self, calls: list[ToolCall], ctx_for: Callable[[ToolCall], ToolContext],
                       *, timeout: float | None = None) -> list[ToolOutcome]:
        """Run calls concurrently; outcomes come back in call order."""
        contexts = [ctx_for(c) for c in calls]
        runs = (self.run(c, x, timeout=timeout) for c, x in zip(calls, contexts, strict=True))
        return list(await asyncio.gather(*runs))

    def _waits_in_coalescer(self, tool: Tool, ctx: ToolContext) -> bool:
        """Whether ``run`` goes straight to the in-process coalescer: no cache to read first,
        no lease held (that call runs directly), and a coalescer that takes the caller's
        timeout (``InflightCoalescer``; any other gets the timeout around ``_resolve``)."""
        return (not tool.cacheable and (tool.shares_calls or ctx.lease is None)
                and isinstance(self._coalescer, InflightCoalescer))

    async def _resolve(self, tool: Tool, key: str, args: ValidatedArgs, ctx: ToolContext,
                       state: dict[str, bool]) -> tuple[str, bool, bool]:
        """(text, served from cache, shared another caller's execution)."""
        if tool.cacheable:
            cache = self._fleet_cache if tool.share == "fleet" else self._cache
            hit = await self._cache_get(cache, key)
            if hit is not None:  # capped again: a fleet-wide entry may come from a larger cap
                return cap_output(hit, self.output_limit(tool)), True, False
        execute = self._thunk(tool, key, args, ctx, state)
        if not tool.shares_calls and ctx.lease is not None:
            return await execute(ctx.lease), False, False
        text, shared = await self._coalescer.run(key, execute, lock_ttl=tool.lock_ttl)
        return text, state.get("cached", False) and not shared, shared

    def _thunk(self, tool: Tool, key: str, args: ValidatedArgs, ctx: ToolContext,
               state: dict[str, bool]) -> Thunk:
        """The execution the coalescer runs (once for every caller sharing it): notes in
        ``state`` that this caller started it, and whether the cache answered meanwhile."""
        if not tool.cacheable:
            def execute(lease: Lease) -> Awaitable[str]:  # (no coroutine of its own)
                state["started"] = True
                return self._execute(tool, args, ctx, lease)
            return execute
        cache = self._fleet_cache if tool.share == "fleet" else self._cache

        async def execute_cached(lease: Lease) -> str:
            state["started"] = True
            hit = await self._cache_get(cache, key)  # an identical call may have filled it
            if hit is not None:
                state["cached"] = True
                return hit
            text = await self._execute(tool, args, ctx, lease)
            await self._cache_set(cache, key, text)
            return text
        return execute_cached

    async def _execute(self, tool: Tool, args: ValidatedArgs, ctx: ToolContext,
                       lease: Lease) -> str:
        """The shared execution: rate limit, then the function under the tool's timeout. The
        tool gets ``ctx`` as seen under ``lease`` (made only for a tool that takes a context:
        nothing else reads it)."""
        bucket = self._buckets.get(tool.name)
        if bucket is not None:
            await bucket.acquire()
        kwargs = dict(args.kwargs)
        if tool.spec.context_param:
            kwargs[tool.spec.context_param] = ctx.under(lease)
        self._bump(tool.name, "executions")
        limit = tool.timeout if tool.timeout is not None else self.default_timeout
        try:
            if limit is None:
                text = await _invoke(tool, kwargs)
            elif _TIMEOUT is not None:  # 3.11+: the deadline on the execution's own task
                async with _TIMEOUT(limit):  # (wait_for made one more task per execution)
                    text = await _invoke(tool, kwargs)
            else:
                text = await wait_for(_invoke(tool, kwargs), limit)
        except asyncio.TimeoutError:
            raise _ExecutionTimeout(_timeout_message(tool.name, limit)) from None
        except ToolError as exc:  # an error's text reaches the model and Redis too
            message = str(exc)
            capped = cap_output(message, self.output_limit(tool))
            if capped is message:
                raise
            raise ToolError(capped) from exc
        return cap_output(text, self.output_limit(tool))

    def output_limit(self, tool: Tool) -> int:
        """The cap on ``tool``'s output: its own, else the batch's."""
        own = tool.max_output_chars
        return own if own is not None else self.max_output_chars

    @staticmethod
    async def _cache_get(cache: ResultCache, key: str) -> str | None:
        try:
            return await cache.get(key)
        except Exception:  # a cache outage degrades to executing, not to failing
            log.warning("tool cache get failed", exc_info=True)
            return None

    async def _cache_set(self, cache: ResultCache, key: str, value: str) -> None:
        try:
            await cache.set(key, value, self.cache_ttl)
        except Exception:
            log.warning("tool cache set failed", exc_info=True)

    def _bump(self, name: str, counter: str) -> None:
        counters = self._stats.get(name)
        if counters is None:
            counters = self._stats[name] = dict.fromkeys(_COUNTERS, 0)
        counters[counter] += 1
        record_tool(name, counter)

    def _error(self, call: ToolCall, message: str, *, shared: bool = False) -> ToolOutcome:
        self._bump(call.name, "errors")
        if shared:
            self._bump(call.name, "coalesced")
        return ToolOutcome(call_id=call.id, name=call.name, content=message, ok=False,
                           coalesced=shared)


class _ExecutionTimeout(ToolError):
    """The shared execution exceeded the tool's timeout (every waiter gets this)."""


async def _invoke(tool: Tool, kwargs: dict[str, Any]) -> str:
    """Call the function; any exception becomes a ``ToolError`` carrying the model's text."""
    try:
        if tool.is_async:
            result = await tool.fn(**kwargs)
        else:
            result = await run_sync(tool.fn, **kwargs)  # daemon thread: see sync_runner
            if inspect.isawaitable(result):
                result = await result
        return to_text(result)
    except ToolError as exc:
        if not str(exc):
            raise ToolError(f"error: {type(exc).__name__}") from exc
        raise
    except Exception as exc:
        raise ToolError(_describe(exc)) from exc


def to_text(result: Any) -> str:
    """A tool result as the text the model sees: strings as-is, everything else as JSON."""
    if isinstance(result, str):
        return result
    if isinstance(result, BaseModel):
        return result.model_dump_json()
    try:
        return pydantic_core.to_json(result, fallback=str).decode()
    except Exception:
        return str(result)


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"error: {type(exc).__name__}: {text}" if text else f"error: {type(exc).__name__}"


def _timeout_message(name: str, seconds: float | None) -> str:
    """``seconds`` is None when no timeout applied and the tool raised TimeoutError itself."""
    if seconds is None:
        return f"error: tool {name!r} timed out"
    return f"error: tool {name!r} timed out after {seconds:g}s"
