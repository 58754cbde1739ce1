"""Run a compiled batch on the embedded engine, in the caller's loop or a thread of its own."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import inspect
import logging
import threading
import time
import weakref
from collections.abc import AsyncIterator, Iterator
from typing import Any

from agentbatch.backends.base import Backend
from agentbatch.backends.hedge import enable_hedging
from agentbatch.backends.setup import (
    inflight_limit,
    open_backend,
    preflight_backend,
    warm_backend,
)
from agentbatch.core.budget import Budget, WorkEstimate
from agentbatch.core.options import BatchOptions
from agentbatch.core.plan import BatchPlan
from agentbatch.core.result_buffer import ResultBuffer
from agentbatch.core.results import AgentResult
from agentbatch.embedded.checkpoint import CheckpointStore, close_checkpoint, open_for_batch
from agentbatch.embedded.engine import EmbeddedEngine
from agentbatch.embedded.metrics import serve_embedded
from agentbatch.embedded.progress import embedded_snapshot
from agentbatch.toolpool import ToolPool, TTLCache
from agentbatch.turnloop.backpressure import BackpressureGate
from agentbatch.turnloop.batch_api import require_batch_client
from agentbatch.turnloop.batch_routing import route_q_for
from agentbatch.turnloop.batch_turns import ProviderBatchTurns
from agentbatch.turnloop.compile import CompiledBatch
from agentbatch.turnloop.handle import BatchHandle
from agentbatch.turnloop.progress import BatchProgress, Throughput
from agentbatch.turnloop.runtime import BatchRuntime
from agentbatch.turnloop.validate import deadline_in

log = logging.getLogger(__name__)
_live: weakref.WeakSet[EmbeddedHandle] = weakref.WeakSet()


async def _learn_context(backend: Backend, plan: BatchPlan) -> None:
    """Ask the context every first turn needs (``context_fit``) before the fan-out, so the
    agents' first turns go straight out instead of waiting on that one ask together (issue
    26 item 5). Advisory: a failure here is met again, and handled, at the first turn."""
    if plan.max_context_tokens is None:
        with contextlib.suppress(Exception):
            await backend.context_length()


async def _warm_and_learn_context(backend: Backend, plan: BatchPlan) -> None:
    """The warm-up and the context ask at once: both stand before the fan-out, and neither
    needs the other's answer. A failed warm-up (the server unreachable) is raised as is."""
    learning = asyncio.create_task(_learn_context(backend, plan))
    try:
        await warm_backend(backend, plan)
    except BaseException:
        learning.cancel()
        raise
    await learning


class EmbeddedHandle(BatchHandle):
    def __init__(self, compiled: CompiledBatch, opts: BatchOptions) -> None:
        self.compiled = compiled
        self.opts = opts
        self.batch_id = compiled.plan.batch_id
        self.total = compiled.plan.total
        self.buffer = ResultBuffer(self.total)
        self.engine: EmbeddedEngine | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._task: asyncio.Task[None] | None = None
        self._pending_cancel = False
        self._checkpoint: CheckpointStore | None = None
        self._rate = Throughput()
        self._final: BatchProgress | None = None
        left = deadline_in(opts.deadline)  # "seconds from submit": counted from here
        self._deadline = None if left is None else time.monotonic() + left

    # --- starting -------------------------------------------------------------------------

    async def _prepare(self) -> BatchRuntime:
        plan = self.compiled.plan
        if self.opts.metrics_port is not None:  # a port in use: refused before any request
            serve_embedded(self.opts.metrics_port)
        backend = open_backend(plan.backends, timeout=plan.timeout_per_turn,
                               batch_prompting=plan.batch_prompting,
                               pool_routing=plan.pool_routing,
                               pool_load_factor=plan.pool_load_factor)
        enable_hedging(backend, self.opts.hedge_after)  # validated: a pool of >= 2
        provider = None
        try:  # the checkpoint first: a bad checkpoint_dir is refused before any request
            self._checkpoint, resumed = await open_for_batch(self.compiled, self.opts)
            await preflight_backend(backend, plan)
            provider = await self._provider_batches(backend)
            # all-batch turns do not go through the sync API whose prefix cache it warms
            if plan.warm_prefix and self.total > 1 and self.opts.pricing != "batch":
                await _warm_and_learn_context(backend, plan)
        except BaseException:
            if provider is not None:
                await provider.aclose()
            await backend.aclose()
            await close_checkpoint(self._checkpoint)
            raise
        pool = ToolPool(self.compiled.tools, cache=TTLCache(max_entries=10_000),
                        max_output_chars=plan.max_tool_output_chars)
        rt = BatchRuntime(plan=plan, contract=self.compiled.contract, tools=pool,
                          backend=backend)
        limit = inflight_limit(plan, backend)
        gate = None
        if plan.max_server_waiting is not None:
            gate = BackpressureGate(backend, max_waiting=plan.max_server_waiting)
        work = WorkEstimate(total=self.total, max_turns=plan.max_turns)
        work.live = sum(not s.terminal for s in resumed.states)
        budget = Budget(plan.prices[plan.model] if plan.prices else None, work,
                        max_cost_usd=self.opts.max_cost_usd,
                        max_agent_cost_usd=self.opts.max_agent_cost_usd)
        self.engine = EmbeddedEngine(rt, resumed.states, self._sink, max_inflight=limit,
                                     gate=gate, checkpoint=self._checkpoint,
                                     ended=resumed.ended, budget=budget, provider=provider)
        if self._pending_cancel:
            self.engine.cancel()
        return rt

    async def _provider_batches(self, backend: Backend) -> ProviderBatchTurns | None:
        """pricing="batch"|"auto": the backend's batch API, found now (refused without one)."""
        pricing = self.opts.pricing
        if pricing == "sync":
            return None
        client = await require_batch_client(backend, self.compiled.plan.backends, pricing)
        plan = self.compiled.plan
        return ProviderBatchTurns(client, backend, mode=pricing, deadline=self._deadline,
                                  total=self.total, concurrency=inflight_limit(plan, backend),
                                  route_q=route_q_for(plan.prices))

    async def _run(self, rt: BatchRuntime) -> None:
        assert self.engine is not None
        try:
            await self.engine.run()
        finally:
            try:
                if self.engine.provider is not None:  # open provider batches cancelled
                    await self.engine.provider.aclose()
                await rt.backend.aclose()
            finally:
                await close_checkpoint(self._checkpoint)  # never raises
                self.buffer.close()

    async def start_in_loop(self) -> None:
        """Start in the running loop (async callers): tools and callbacks share their loop."""
        self._loop = asyncio.get_running_loop()
        rt = await self._prepare()
        self._task = asyncio.create_task(self._run(rt), name=f"agentbatch-{self.batch_id}")
        _live.add(self)

    def start_threaded(self) -> None:
        """Start on a private loop in a background thread (sync callers)."""
        ready = threading.Event()
        startup_error: list[BaseException] = []

        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            try:
                rt = await self._prepare()
            except BaseException as exc:
                startup_error.append(exc)
                ready.set()
                return
            ready.set()
            await self._run(rt)

        self._thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True,
                                        name=f"agentbatch-{self.batch_id}")
        self._thread.start()
        ready.wait()
        if startup_error:
            self._thread.join()
            raise startup_error[0]
        _live.add(self)

    # --- results --------------------------------------------------------------------------

    def _sink(self, result: AgentResult) -> None:
        self.buffer.put(result)  # first, so a failing callback can never lose a result
        callback = self.opts.on_result
        if callback is None:
            return
        try:
            ret = callback(result)
            if inspect.isawaitable(ret):
                task = asyncio.ensure_future(ret)
                task.add_done_callback(_log_callback_error)
        except Exception:
            log.exception("on_result raised for agent %s; the batch continues", result.index)

    def results(self, timeout: float | None = None) -> Iterator[AgentResult]:
        return self.buffer.iter(timeout=timeout)

    def aresults(self) -> AsyncIterator[AgentResult]:
        return self.buffer.aiter()

    def status(self) -> dict[str, int]:
        counts = self.engine.counts() if self.engine else {"needs_model": self.total}
        counts["total"] = self.total
        counts["finished"] = int(self.buffer.finished)
        counts["delivered"] = len(self.buffer)
        return counts

    def progress(self) -> BatchProgress:
        """Counts, tokens, throughput and ETA from the engine's in-memory states."""
        if self._final is not None:
            return self._final
        finished = self.buffer.finished
        snap = embedded_snapshot(self.engine, batch_id=self.batch_id, total=self.total,
                                 finished=finished, rate=self._rate)
        if finished:  # frozen: elapsed stops at the end
            self._final = snap
        return snap

    def stats(self) -> dict[str, object]:
        """Requests sent, retries, peak in-flight requests and tool-pool counters."""
        if self.engine is None:
            return {}
        from agentbatch.backends.setup import pool_stats

        backend = self.engine.rt.backend
        return {
            "requests_sent": backend.requests_sent,
            "retries": backend.retries,
            "peak_inflight": self.engine.slots.peak,
            "tools": self.engine.rt.tools.stats(),
            "pool": pool_stats(backend),  # None for one URL
            # pricing="batch"|"auto": turns served by each API, hedges, provider batches
            "provider_batch": (dict(self.engine.provider.stats)
                               if self.engine.provider is not None else {}),
        }

    def cancel(self) -> None:
        self._pending_cancel = True
        if self.engine is None or self._loop is None or self._loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop may have finished already
            self._loop.call_soon_threadsafe(self.engine.cancel)

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def close(self) -> None:
        if not self.buffer.finished:
            self.cancel()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)


def _log_callback_error(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("async on_result raised; the batch continues", exc_info=task.exception())


@atexit.register
def _cancel_live_batches() -> None:
    """At interpreter exit, stop embedded batches cleanly instead of killing them mid-call."""
    for handle in list(_live):
        if not handle.buffer.finished:
            handle.cancel()
            handle.join(timeout=5)
