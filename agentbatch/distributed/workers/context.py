"""Per-process worker resources: one Redis client, loaded batches, backends, semaphores.

Everything here lives on the process's asyncio loop (see ``loop.py``) and is shared by every
task thread of the process, so connection pools and loaded tools are reused across turns.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from agentbatch.backends.base import Backend
from agentbatch.backends.setup import (
    inflight_limit,
    learn_inflight_hint,
    open_backend,
    spread_first_turns,
)
from agentbatch.core.errors import BatchSpecError, ConfigError, RateLimited
from agentbatch.core.output import OutputContract
from agentbatch.core.plan import BatchPlan
from agentbatch.core.results import ErrorKind
from agentbatch.core.turns import TurnPolicy
from agentbatch.distributed.provider_batches import ProviderBatches
from agentbatch.distributed.state.connection import async_client
from agentbatch.distributed.state.keys import TOOL_DONE_CHANNEL
from agentbatch.distributed.state.note_hub import NoteHub
from agentbatch.distributed.state.redis_store import BatchStore
from agentbatch.distributed.state.scripts import Scripts
from agentbatch.distributed.state.semaphore import RedisSemaphore
from agentbatch.distributed.state.slot_map import share_fleet_slots
from agentbatch.distributed.tool_coalesce import RedisCoalescer, RedisResultCache
from agentbatch.distributed.tool_rate import redis_buckets
from agentbatch.distributed.workers.batch_stats import BatchStats
from agentbatch.distributed.workers.hedging import (
    BatchTagged,
    count_batch_moves,
    enable_batch_hedging,
)
from agentbatch.distributed.workers.settings import WorkerSettings
from agentbatch.metrics import EventCounter
from agentbatch.toolpool import ToolPool
from agentbatch.turnloop.backpressure import BackpressureGate
from agentbatch.turnloop.runtime import BatchRuntime, load_schema, load_tools

log = logging.getLogger(__name__)
_MAX_LOADED_BATCHES = 64
_UNREADABLE_LOG_S = 60.0  # an unreadable plan is logged at most this often per batch


@dataclass
class LoadedBatch:
    """A batch as this process can run it; ``error`` set when its tools/schema won't import."""

    plan: BatchPlan
    store: BatchStore
    policy: TurnPolicy
    runtime: BatchRuntime | None
    error: str | None = None
    error_kind: ErrorKind = "tool_import"
    plan_unreadable: bool = False  # a sweep stand-in (``WorkerContext.unreadable_batch``)


class WorkerContext:
    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.redis = async_client(settings.redis_url)
        self.scripts = Scripts(self.redis)
        self.hub = NoteHub(self.redis, TOOL_DONE_CHANNEL)
        # a shared call's lock lives as long as a turn's lease (a tool's lock_ttl overrides)
        self.coalescer = RedisCoalescer(self.redis, self.scripts, self.hub,
                                        lock_ttl_ms=settings.lease_ttl_ms)
        self.cache = RedisResultCache(self.redis)
        self.stats: Counter[str] = EventCounter()  # also agentbatch_events_total
        # a pool's moves and hedges, per batch, written in the background (``batch_stats``)
        self.batch_stats = BatchStats(self.redis, self.scripts)
        self._pools: set[tuple[str, ...]] = set()  # backends' URLs that open a pool
        # pricing="batch": this process's turns gathered into provider batches
        self.provider_batches = ProviderBatches(self.note, self.batch_stats)
        self._batches: OrderedDict[str, LoadedBatch] = OrderedDict()
        # a batch being loaded: the task threads' first turns of a batch all arrive at once
        # (16 per worker), and each loaded the plan, tools and backend on its own connection
        self._loading: dict[str, asyncio.Future[LoadedBatch | ValidationError | None]] = {}
        # one per pool of URLs, ``hedge_after`` and routing: a hedging pool is not shared
        # with batches that do not hedge (``hedging.py``), nor one pool by two routings
        self._backends: dict[tuple[tuple[str, ...], float | None, str, float], Backend] = {}
        self._semaphores: dict[tuple[str, int], RedisSemaphore] = {}
        self._gates: dict[tuple[tuple[str, ...], int], BackpressureGate] = {}
        self._unreadable_logged: dict[str, float] = {}  # batch id -> when last logged

    def store(self, batch_id: str) -> BatchStore:
        return BatchStore(self.redis, self.scripts, batch_id)

    async def batch(self, batch_id: str) -> LoadedBatch | None:
        """The loaded batch, or None when Redis has no such batch (finished long ago or lost)
        or this worker cannot read its plan (``_unreadable``). Loaded once: the tasks that
        ask while it loads wait for that load."""
        loaded = self._batches.get(batch_id)
        if loaded is not None:
            self._batches.move_to_end(batch_id)
            return loaded
        pending = self._loading.get(batch_id)
        if pending is None:
            pending = self._loading[batch_id] = asyncio.ensure_future(self._fetch(batch_id))
            pending.add_done_callback(lambda done: self._loaded(batch_id, done))
        found = await asyncio.shield(pending)  # one waiter cancelled does not stop the load
        if isinstance(found, ValidationError):  # written by another version, or tampered with
            await self._unreadable(batch_id, found)
            return None
        return found

    def _loaded(self, batch_id: str,
                done: asyncio.Future[LoadedBatch | ValidationError | None]) -> None:
        if self._loading.get(batch_id) is done:
            del self._loading[batch_id]
        if not done.cancelled():
            done.exception()  # retrieved: each waiter raises it (or none is left to)

    async def _fetch(self, batch_id: str) -> LoadedBatch | ValidationError | None:
        """Load the batch and remember it; its plan's parse error is returned, not raised."""
        store = self.store(batch_id)
        try:
            plan = await store.load_plan()
        except ValidationError as exc:
            return exc
        if plan is None:
            return None
        loaded = self._load(plan, store)
        if loaded.runtime is not None:
            # the server's slot count (llama.cpp /props) caps the fleet's in-flight turns,
            # as in the embedded engine (``semaphore``); unknown if the server cannot say
            await learn_inflight_hint(loaded.runtime.backend)
            # turns pinned to llama.cpp slots alike on every worker (``slot_map.py``)
            share_fleet_slots(loaded.runtime.backend, plan, self.scripts)
            # first turns of a pool spread alike on every worker (``EndpointPool``)
            spread_first_turns(loaded.runtime.backend)
        self._remember(batch_id, loaded)
        return loaded

    async def _unreadable(self, batch_id: str, exc: ValidationError) -> None:
        """A plan this worker cannot parse: nothing of the batch runs or commits here (a
        placeholder plan once ended agents and, with its total of 0, finished the whole batch
        under the workers that could run it). Not remembered: the next task reads it again,
        so a repaired plan, or a worker of the right version, picks the agents up (the sweep
        re-sends a dropped task once its deadline passes)."""
        now = time.monotonic()
        if now - self._unreadable_logged.get(batch_id, -_UNREADABLE_LOG_S) >= _UNREADABLE_LOG_S:
            self._unreadable_logged[batch_id] = now
            log.error("batch %s has a plan this worker cannot read (another version wrote it, "
                      "or it was damaged); its tasks are left to a worker that can: %s",
                      batch_id, exc)
        await self.note(batch_id, "plan_unreadable")

    async def unreadable_batch(self, batch_id: str) -> LoadedBatch | None:
        """For the sweep only: a stand-in for a batch whose plan exists but this worker cannot
        read (None when the plan reads, or is missing). It runs nothing (``runtime`` None,
        ``plan_unreadable`` set) and is never cached; the sweep re-sends the agents' dropped
        tasks through it, for a worker that can read the plan, and ends them with kind
        ``config`` once the re-send cap is used up (``sweep._resend``). Its plan holds only
        the batch id and ``created_at`` (meta's): the total a commit checks is meta's."""
        store = self.store(batch_id)
        try:
            if await store.load_plan() is not None:
                return None
        except ValidationError as exc:
            detail = str(exc).splitlines()[0][:200]
        else:
            return None
        created = await self.redis.hget(store.k.meta, "created_at")
        try:
            created_at = float(created or 0) or time.time()
        except ValueError:
            created_at = time.time()
        plan = BatchPlan(batch_id=batch_id, total=0, model="", backends=[], system_message="",
                         created_at=created_at)
        from agentbatch.core.version import __version__

        error = (f"the batch's plan cannot be read by this worker version (agentbatch "
                 f"{__version__}): it was written by another version or damaged ({detail})")
        policy = TurnPolicy(max_turns=1, max_retries=0, parse_output=OutputContract(None).parse)
        return LoadedBatch(plan=plan, store=store, policy=policy, runtime=None, error=error,
                           error_kind="config", plan_unreadable=True)

    def _remember(self, batch_id: str, loaded: LoadedBatch) -> None:
        self._batches[batch_id] = loaded
        while len(self._batches) > _MAX_LOADED_BATCHES:
            self._batches.popitem(last=False)

    def _load(self, plan: BatchPlan, store: BatchStore) -> LoadedBatch:
        try:
            tools = load_tools(plan, allowed_imports=self.settings.worker_imports)
        except BatchSpecError as exc:
            return self._broken(plan, store, str(exc), "tool_import")
        try:
            schema = load_schema(plan, allowed_imports=self.settings.worker_imports)
        except BatchSpecError as exc:
            return self._broken(plan, store, str(exc), "schema_import")
        contract = OutputContract(schema)
        pool = ToolPool(tools, coalescer=self.coalescer, cache=self.cache, fleet_cache=self.cache,
                        bucket_factory=redis_buckets(self.redis, self.scripts),
                        max_output_chars=plan.max_tool_output_chars)
        try:
            backend = self._backend(plan)
        except (BatchSpecError, ConfigError) as exc:  # a hostfile, a key, a URL of this node
            return self._broken(plan, store, f"the backend cannot be opened on this worker: "
                                f"{exc}", "config")
        except Exception as exc:
            return self._broken(plan, store, f"the backend cannot be opened on this worker: "
                                f"{type(exc).__name__}: {exc}", "backend_unavailable")
        if tuple(plan.backends) in self._pools:  # whose turn each race and move is
            backend = BatchTagged(backend, plan.batch_id)
        rt = BatchRuntime(plan=plan, contract=contract, tools=pool, backend=backend)
        return LoadedBatch(plan=plan, store=store, policy=rt.policy, runtime=rt)

    def _broken(self, plan: BatchPlan, store: BatchStore, error: str,
                kind: ErrorKind) -> LoadedBatch:
        log.error("batch %s cannot run on this worker: %s", plan.batch_id, error)
        policy = TurnPolicy(max_turns=plan.max_turns, max_retries=plan.max_retries,
                            parse_output=OutputContract(None).parse)
        return LoadedBatch(plan=plan, store=store, policy=policy, runtime=None, error=error,
                           error_kind=kind)

    def _backend(self, plan: BatchPlan) -> Backend:
        key = (tuple(plan.backends), plan.hedge_after, plan.pool_routing, plan.pool_load_factor)
        backend = self._backends.get(key)
        if backend is None:
            # trust_key_env=False: the plan may not pick which of our variables is a key.
            backend = open_backend(plan.backends, timeout=plan.timeout_per_turn,
                                   batch_prompting=plan.batch_prompting, trust_key_env=False,
                                   pool_routing=plan.pool_routing,
                                   pool_load_factor=plan.pool_load_factor)
            if plan.hedge_after is not None:  # as the embedded handle does, once it is open
                enable_batch_hedging(backend, plan.hedge_after, self.batch_stats.add)
            if count_batch_moves(backend, self.batch_stats.add):
                self._pools.add(tuple(plan.backends))
            backend.listeners.append(lambda error: self._on_retry(plan, backend, error))
            self._backends[key] = backend
        return backend

    def _on_retry(self, plan: BatchPlan, backend: Backend, error: BaseException) -> None:
        """A throttle anywhere in the fleet halves the shared limit (fleet-wide AIMD)."""
        if isinstance(error, RateLimited):
            task = asyncio.ensure_future(self.semaphore(plan, backend).on_throttle())
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    def gate(self, plan: BatchPlan, backend: Backend) -> BackpressureGate | None:
        if plan.max_server_waiting is None:
            return None
        key = (tuple(plan.backends), plan.max_server_waiting)
        gate = self._gates.get(key)
        if gate is None:
            gate = self._gates[key] = BackpressureGate(backend,
                                                       max_waiting=plan.max_server_waiting)
        return gate

    def semaphore(self, plan: BatchPlan, backend: Backend) -> RedisSemaphore:
        limit = inflight_limit(plan, backend)
        name = hashlib.sha1("|".join(plan.backends).encode()).hexdigest()[:16]
        sem = self._semaphores.get((name, limit))
        if sem is None:
            sem = RedisSemaphore(self.redis, self.scripts, name, limit,
                                 ttl_ms=self.settings.lease_ttl_ms, woken=True)
            self._semaphores[(name, limit)] = sem
        return sem

    async def note(self, batch_id: str, what: str, n: int = 1) -> None:
        """Count an event both locally and on the batch (the chaos report reads these)."""
        self.stats[what] += n
        try:
            await self.scripts.note(keys=[self.store(batch_id).k.meta],
                                    args=[f"stat:{what}", n])
        except Exception:  # statistics must never break a turn
            log.debug("could not record stat %s", what, exc_info=True)


_context: WorkerContext | None = None
_context_pid: int | None = None


def worker_context(settings: Any = None) -> WorkerContext:
    """This process's context (created on first use, fresh after a fork)."""
    global _context, _context_pid
    if _context is None or _context_pid != os.getpid():
        _context = WorkerContext(settings or WorkerSettings.from_env())
        _context_pid = os.getpid()
    return _context
