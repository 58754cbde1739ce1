"""``pricing="batch"`` / ``"auto"`` on the distributed engine: a worker's model turns through a
provider's batch API, provider batches per (backend, model) for the turns ready within
``WINDOW_S``.

Routing and hedging (``route``, ``complete``'s ``hedge``) are ``turnloop.batch_routing``'s, as
on the embedded engine, with one ``Router`` per batch in each worker process: each worker
routes on the sync latencies it observed itself (its first routed turn is its probe), like
``hedge_after``'s per-worker p95s, and on the provider batch latencies of the whole fleet: a
provider batch that ends adds its latency to the batch's ``latency_key`` list, and a worker
building its router for the batch starts from that list (``router_for``), so one that joins
mid-batch does not route blind. The deadline is the plan's ``deadline_at``, in Redis's clock
(``now_ms``). An agent's turns left come from its state and the mean turns of the agents this
worker saw finish; the batch's live count from its meta (``total - delivered``), read at most
once a second per batch. A turn routed to the sync API is counted on the batch
(``stat:routed_sync_probe|tail|deadline``), a turn routed to the batch API in
``stat:provider_batch_items`` (not per turn: that would be a Redis write per turn), and one
sent in a provider batch smaller than the provider's maximum in ``stat:routed_batch_small``
(``stat:routed_batch_explore`` when it went to learn that size), gathered with the other
counts in the worker's background ``BatchStats``. A turn
waiting past the router's hedge time races the sync API (``stat:batch_hedged``), unless the
sync path is at the router's hedge cap (``stat:hedge_capped``: it keeps waiting); the first
answer is returned, so the turn commits once (``stat:hedge_won_by_sync`` /
``hedge_won_by_batch``); a provider batch whose turns were all answered by the sync API is
cancelled.

A provider bills every request of a batch that completed, even in a batch cancelled later.
So a turn whose sync hedge won keeps its ``custom_id`` in ``_lost`` until its provider batch
has ended (a cancelled one is polled until the provider says it has), and its item is read
with the others'. An answer there was paid at the batch prices: it is added to the batch's
``spend`` in Redis (which the claims' ``max_cost_usd`` check and ``progress()`` read) and
counted (``stat:hedge_lost_batch_paid``, ``stat:hedge_lost_batch_paid_prompt_tokens`` /
``_completion_tokens``), in one atomic script (``lua/pay_lost.lua``). It is in no result's
``cost_usd``: the agent has moved on, and may have ended. A request not completed when its
batch was cancelled was not paid. A provider batch polled only for that bill (nobody here
waits on its turns) is polled until the later of its batches' deadline and ``CLOSE_BILL_S``
from then (the embedded engine's bound, ``batch_turns._pay_lost``), not until the provider's
24 h expiry: one whose cancel is stuck, or that runs on, is then given up, with a warning and
``stat:hedge_lost_batch_unknown`` (its turns whose bill is not known), as is one whose items
could not be read. What a worker stopped or killed before its provider batch ended would have
read is not known (``stat:hedge_won_by_sync`` bounds it).

A hedge's sync request is billed whether or not its answer is committed. So before sending it,
the worker records the intent in the batch's ``pbatch`` hash (``hedge_intent``: field
``"s:<index>:<version>"`` -> its lease token, one round trip per hedge, none per other turn;
the same for a failed item sent to the sync API, ``provider_batch_fallback_sync``),
and the same round trip that drops the turn's record after its commit drops it
(``forget``). A worker killed with the request in flight (or whose lease lapsed) leaves it,
and whoever takes the turn over counts it, once, in ``stat:hedge_sync_paid_unknown`` (a
request paid, its tokens not known, so not in the spend) with a warning naming the batch and
the agent: the sweep's re-send, in the script that counts the re-send (``stat:recovered``,
``resend.lua``), or a duplicate delivery's commit or hedge. A live worker whose lease lapsed
and that still commits its answer is counted too (an over-count, never a silent miss).

Routing and hedge counts go through the worker's background counters (``BatchStats``: one
transaction per flush, not a round trip per event); those that must be on the batch before
what follows them are flushed at once, shared by the callers of one pass of the loop: a
hedge's ``batch_hedged`` before its request, its outcome before the turn commits, a cancel
before the provider sees it. The submission counts (``stat:provider_batches``,
``stat:provider_batch_items``) and the re-send counts (``stat:provider_batch_adopted``,
``stat:provider_batch_resubmitted``) are written at once (the accounting reads them).

A turn's ``custom_id`` names its agent version (``custom_id``), so a result can only ever
answer the turn it was asked for; it commits through the same versioned compare-and-set as a
sync reply (``steps.run_turn``). The worker holds the turn's lease the whole time it waits (the
renewal keeps it, and the agent's progress deadline, one lease ahead).

What a killed worker leaves behind is in Redis, in the batch's ``pbatch`` hash: field
``"<index>:<version>"`` -> the provider batch id that holds that turn, or ``SUBMITTING``
while the submit is under way. The turn the sweep re-sends looks it up first:

- a provider batch id: it polls that batch and takes its result (``stat:provider_batch_adopted``);
  nothing is submitted or paid again;
- ``SUBMITTING``: the dead worker may or may not have created the provider batch, so the turn
  is submitted again and counted (``stat:provider_batch_resubmitted``): a double payment is
  possible then, and never silent;
- nothing: an ordinary first submit.

Every submission is counted before it is sent (``stat:provider_batches``,
``stat:provider_batch_items``), so the provider's count of batches can never exceed the
batch's own. A turn whose item failed or expired goes to the sync API
(``stat:provider_batch_fallback_sync``) while the deadline allows, as on the embedded engine;
else it fails with an error that says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import socket
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from agentbatch.backends.base import Backend
from agentbatch.backends.provider_batch import (
    ItemError,
    ItemResult,
    ProviderBatchClient,
    batch_client,
)
from agentbatch.backends.setup import endpoints
from agentbatch.core.agent_state import AgentState
from agentbatch.core.errors import (
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    BadRequest,
    BatchCancelled,
    BatchSpecError,
    ServerError,
)
from agentbatch.core.model_io import ModelRequest, ModelResponse, Usage
from agentbatch.core.plan import BatchPlan
from agentbatch.core.pricing import cost_usd
from agentbatch.core.wait_for import wait_for
from agentbatch.distributed.state.redis_store import BatchStore, now_ms
from agentbatch.distributed.workers.batch_stats import BatchStats
from agentbatch.turnloop.batch_routing import (
    DEFAULT_MAX_ITEMS,
    WINDOW_S,
    Route,
    Router,
    route_q_for,
)
from agentbatch.turnloop.batch_turns import (
    CLOSE_BILL_S,
    MAX_POLL_S,
    MAX_WAIT_S,
    POLL_S,
    POLL_SHARE,
    below_min,
    split_chunks,
    with_sync_loser,
)

log = logging.getLogger(__name__)

SUBMITTING = "?"  # the record of a turn whose provider batch is being created
RECORD_TTL_MS = 26 * 3600 * 1000  # past the providers' 24 h completion window
CANCEL_CHECK_S = 2.0  # how often a waiting turn looks at the batch's cancel flag
LIVE_CACHE_S = 1.0  # a batch's live count is read from its meta at most this often
SHARED_LATENCIES = 200  # the provider batch latencies a batch keeps for the fleet (newest)
MAX_BATCHES_KEPT = 256  # batches whose routing state one worker keeps (``_forget``)
# a turn taken over from a holder whose sync hedge request was in flight (its intent left)
_LEFT_BEHIND = ("batch %s: agent %s v%s: another worker had its sync hedge request in flight "
                "and did not commit it (killed, or its lease lapsed); the provider bills it, "
                "its tokens are not known (stat:hedge_sync_paid_unknown)")

Hedge = Callable[[], Awaitable[ModelResponse]]  # the turn's request on the sync API

Note = Callable[[str, str, int], Awaitable[None]]  # (batch id, stat, n)


def custom_id(batch_id: str, index: int, version: int) -> str:
    """The ``custom_id`` of one agent version's turn: ``[A-Za-z0-9_-]{1,64}`` (Anthropic's
    rule), unique across the batches that may share a provider batch."""
    tag = hashlib.sha1(batch_id.encode()).hexdigest()[:16]
    return f"ab-{tag}-{index}-{version}"


def record_field(index: int, version: int) -> str:
    return f"{index}:{version}"


def intent_field(index: int, version: int) -> str:
    """The ``pbatch`` field of one agent version's sync hedge intent (``lua/hedge_intent.lua``;
    ``resend.lua`` builds the same name)."""
    return f"s:{index}:{version}"


def latency_key(store: BatchStore) -> str:
    """The batch's list of provider batch latencies observed fleet-wide, newest first, each
    ``"<seconds>:<turns>"`` (beside its ``pbatch`` records, with their TTL)."""
    return f"{store.k.provider_batches}:latency"


def redis_clock() -> float:
    """Seconds in Redis's clock (the plan's ``deadline_at`` is in it)."""
    return now_ms() / 1000


@dataclass
class _Turn:
    """A turn waiting in this process for its provider batch's answer."""

    store: BatchStore
    index: int
    version: int
    request: ModelRequest
    future: asyncio.Future[ItemResult]
    resubmit: bool = False  # its record said SUBMITTING: counted as resubmitted already
    cap: int = DEFAULT_MAX_ITEMS  # the provider batch size it may go in (``Router.pick_size``)


@dataclass
class _Lost:
    """A turn the sync API answered whose provider batch may still bill it: its batch, the
    batch model's prices (None: not priced) and the batch's deadline (Redis clock; None:
    none), which bounds how long its provider batch is polled for the bill."""

    store: BatchStore
    prices: dict[str, float] | None
    deadline: float | None = None


@dataclass
class _Lane:
    """The turns of one (backend, model) gathering for the next provider batch."""

    client: ProviderBatchClient
    pending: list[tuple[str, _Turn]] = field(default_factory=list)
    flusher: asyncio.Task[None] | None = None


@dataclass
class _Submitted:
    """A provider batch this process submitted (or adopted): when, its size, its turns, and
    those the sync API answered (a hedge won)."""

    at: float  # redis_clock()
    size: int | None
    members: set[str] = field(default_factory=set)
    answered_sync: set[str] = field(default_factory=set)


class ProviderBatches:
    """The provider-batch side of one worker process (on its asyncio loop)."""

    def __init__(self, note: Note, stats: BatchStats | None = None) -> None:
        self.note = note  # a count on the batch at once: one round trip
        # a count gathered with others, written in the background: the worker's
        # ``BatchStats`` when given, else one of this object's own (``_stats``)
        self._batch_stats = stats
        self._clients: dict[tuple[str, ...], ProviderBatchClient | None] = {}
        self._lanes: dict[tuple[str, ...], _Lane] = {}
        self._lock = asyncio.Lock()
        self._futures: dict[str, asyncio.Future[ItemResult]] = {}
        self._watchers: dict[str, asyncio.Task[None]] = {}  # provider batch id -> poller
        self._wanted: dict[str, set[str]] = {}  # provider batch id -> custom ids waited on
        # provider batch id -> the agentbatch batches whose turns it holds (id -> store)
        self._owners: dict[str, dict[str, BatchStore]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        # routing: per agentbatch batch, this process's own observations
        self._routers: dict[str, Router] = {}
        self._submitted: dict[str, _Submitted] = {}  # provider batch id -> what it holds
        self._owner_of: dict[str, str] = {}  # custom id -> provider batch id
        self._waiting: Counter[str] = Counter()  # batch id -> its turns waiting here
        self._live: dict[str, tuple[float, int]] = {}  # batch id -> (read at, live agents)
        self._finished: dict[str, tuple[int, int]] = {}  # batch id -> (agents ok, their turns)
        self._shared_read: set[str] = set()  # batches whose fleet latencies were read here
        # provider batch id -> custom id -> a turn the sync API answered (``_pay_lost``)
        self._lost: dict[str, dict[str, _Lost]] = {}
        # batch id -> what a turn the sync API answered carries (``_lost_turn``): its model's
        # prices and its deadline_at
        self._bill_terms: dict[str, tuple[dict[str, float] | None, float | None]] = {}

    def _stats(self, store: BatchStore) -> BatchStats:
        """The background counters (made on first use from the batch's Redis client: every
        store of a worker shares its client)."""
        if self._batch_stats is None:
            self._batch_stats = BatchStats(store.r, store.s)
        return self._batch_stats

    # --- routing ----------------------------------------------------------------------------

    def router(self, plan: BatchPlan) -> Router:
        """This process's router for ``plan``'s batch (created on its first turn)."""
        router = self._routers.get(plan.batch_id)
        if router is None:
            mode: Literal["batch", "auto"] = "auto" if plan.pricing == "auto" else "batch"
            batch_id = plan.batch_id

            def running() -> list[tuple[float, int]]:
                now = redis_clock()
                return [(now - sub.at, sub.size) for pb, sub in self._submitted.items()
                        if sub.size is not None and batch_id in self._owners.get(pb, {})]

            router = Router(mode, plan.deadline_at, plan.total, clock=redis_clock,
                            running=running, route_q=route_q_for(plan.prices))
            if len(self._routers) >= MAX_BATCHES_KEPT:
                self._forget(next(iter(self._routers)))
            self._routers[batch_id] = router
        return router

    def _forget(self, batch_id: str) -> None:
        """Drop what this process keeps per agentbatch batch (its router, counts and billing
        terms), for the oldest batch once ``MAX_BATCHES_KEPT`` have routers: a long-lived
        worker serves batch after batch. A batch still running builds them again on its next
        turn (the terms are set on every turn, the router reads the fleet's latencies)."""
        kept: dict[str, Any]
        for kept in (self._routers, self._live, self._finished, self._bill_terms):
            kept.pop(batch_id, None)
        self._shared_read.discard(batch_id)

    async def router_for(self, plan: BatchPlan, store: BatchStore) -> Router:
        """``router``, which starts from the provider batch latencies the fleet observed for
        the batch so far (``latency_key``; read once, when this process builds it): a worker
        that joins mid-batch routes and hedges on the fleet's p50/p90, not blind."""
        router = self.router(plan)
        if plan.batch_id in self._shared_read:
            return router
        self._shared_read.add(plan.batch_id)
        try:
            shared = await store.r.lrange(latency_key(store), 0, SHARED_LATENCIES - 1)
        except Exception:  # Redis unreachable: this worker's own observations only
            log.debug("could not read batch %s's shared latencies", plan.batch_id,
                      exc_info=True)
            self._shared_read.discard(plan.batch_id)
            return router
        read = 0
        for raw in shared:
            text = raw.decode() if isinstance(raw, bytes) else str(raw)
            seconds, _, size = text.partition(":")
            with contextlib.suppress(ValueError):
                router.batch_latency.add(float(seconds), int(size or 1))
                read += 1
        router.stats["batch_latencies_shared_read"] += read
        return router

    async def _share(self, stores: list[BatchStore], seconds: float, size: int) -> None:
        """Add one provider batch's latency to each batch's fleet list (newest first, the
        last ``SHARED_LATENCIES`` kept), one round trip per batch."""
        for store in stores:
            key = latency_key(store)
            try:
                pipe = store.r.pipeline(transaction=False)
                pipe.lpush(key, f"{seconds:.3f}:{size}")
                pipe.ltrim(key, 0, SHARED_LATENCIES - 1)
                pipe.pexpire(key, RECORD_TTL_MS)
                await pipe.execute()
            except Exception:  # the fleet routes on less; this worker keeps its own
                log.debug("could not share a provider batch latency", exc_info=True)

    def agent_finished(self, batch_id: str, turns: int) -> None:
        """An agent of the batch ended ok after ``turns`` replies (the turns-left estimate)."""
        n, total = self._finished.get(batch_id, (0, 0))
        self._finished[batch_id] = (n + 1, total + turns)

    def turns_left(self, plan: BatchPlan, state: AgentState) -> float:
        """The estimated turns ``state`` still needs, this one included (>= 1): the mean of
        the agents this worker saw finish ok, ``max_turns`` before any (``WorkEstimate``)."""
        n, total = self._finished.get(plan.batch_id, (0, 0))
        per_agent = total / n if n else float(plan.max_turns)
        return max(per_agent - state.turns, 1.0)

    async def live(self, plan: BatchPlan, store: BatchStore) -> int:
        """The batch's agents still running, from its meta, read at most every
        ``LIVE_CACHE_S`` (every turn asks)."""
        now = time.monotonic()
        hit = self._live.get(plan.batch_id)
        if hit is not None and now - hit[0] < LIVE_CACHE_S:
            return hit[1]
        try:
            delivered = await store.r.hget(store.k.meta, "delivered")
            live = max(plan.total - int(delivered or 0), 0)
        except Exception:  # Redis unreachable: the last count (or all), the turn goes on
            live = hit[1] if hit is not None else plan.total
        self._live[plan.batch_id] = (now, live)
        return live

    async def route(self, plan: BatchPlan, store: BatchStore, state: AgentState) -> Route:
        """Where this turn goes (``Router.route``); a turn routed to the sync API is counted
        on the batch, and is in the router's sync backlog until ``timed_sync`` or
        ``unroute``."""
        return (await self.route_sized(plan, store, state))[0]

    async def route_sized(self, plan: BatchPlan, store: BatchStore,
                          state: AgentState) -> tuple[Route, int | None]:
        """``route``, and for the batch API the provider batch size the turn may go in
        (``Router.decide``; ``complete``'s ``size``; None: full)."""
        router = await self.router_for(plan, store)
        if router.mode == "batch" or router.deadline is None:
            return "batch", None
        explored = router.stats["routed_batch_explore"]
        where, why, size = router.decide(self.turns_left(plan, state),
                                         await self.live(plan, store))
        if where == "batch" and size < router.sizes()[0]:
            # on the batch, as on the embedded engine (gathered: no write of its own)
            stats = self._stats(store)
            stats.add(plan.batch_id, "routed_batch_small")
            if router.stats["routed_batch_explore"] > explored:
                stats.add(plan.batch_id, "routed_batch_explore")
        if where == "sync":
            # a turn re-sent from a worker that stopped may be in a provider batch already:
            # it waits on that one (paid for) rather than paying the sync API as well
            with contextlib.suppress(Exception):
                found = await store.r.hget(store.k.provider_batches,
                                           record_field(state.index, state.version))
                if found and found != SUBMITTING:
                    router.stats[why] -= 1
                    router.unroute()
                    return "batch", None
            stats = self._stats(store)
            stats.add(plan.batch_id, why)
            stats.settle()  # on its way before the turn's request is (not waited on here)
        return where, size

    async def client(self, plan: BatchPlan, backend: Backend) -> ProviderBatchClient:
        """The backend's batch client, found once per process. Not found (the submitter
        found it, so the server is down or this worker reaches another one): a retryable
        ``BackendUnavailable``, asked again on the next turn."""
        key = (*plan.backends, plan.model)
        async with self._lock:
            if self._clients.get(key) is None:
                drivers = endpoints(backend)
                try:
                    self._clients[key] = (await batch_client(drivers[0])
                                          if len(drivers) == 1 else None)
                except BatchSpecError as exc:  # set up on the submitter, not on this worker
                    raise BadRequest(f"{exc} (on worker {socket.gethostname()})") from exc
        found = self._clients[key]
        if found is None:
            raise BackendUnavailable(
                f'pricing="batch": backend {", ".join(plan.backends)} has no provider batch '
                "API from this worker (OpenAI's /v1/batches or Anthropic's "
                "/v1/messages/batches did not answer)")
        if key not in self._lanes:
            self._lanes[key] = _Lane(found)
        return found

    async def complete(self, plan: BatchPlan, backend: Backend, store: BatchStore, index: int,
                       version: int, request: ModelRequest, *, turns_left: float = 1.0,
                       hedge: Hedge | None = None, token: str = "",
                       size: int | None = None) -> tuple[ItemResult, bool]:
        """The answer to this agent version's turn and whether the provider batch gave it:
        from the provider batch a record names (a re-sent turn), else from a new one; with
        ``hedge``, from the sync API when the turn is still waiting at the router's hedge
        time and the sync API answers first (``token``: the turn's lease, which its hedge
        intent names; ``size``: the provider batch size it may go in, ``route_sized``'s, None
        for full). ``BatchCancelled`` once the batch is cancelled; ``BackendTimeout``
        after ``MAX_WAIT_S`` without an answer."""
        await self.client(plan, backend)
        key = (*plan.backends, plan.model)
        lane = self._lanes[key]
        cid = custom_id(plan.batch_id, index, version)
        self._bill_terms[plan.batch_id] = ((plan.prices or {}).get(plan.model),
                                           plan.deadline_at)
        router = await self.router_for(plan, store)
        router.max_items, router.min_items = lane.client.max_items, lane.client.min_items
        future = self._futures.get(cid)
        if future is None or future.done():
            future = asyncio.get_running_loop().create_future()
            self._futures[cid] = future
            found = await store.r.hget(store.k.provider_batches,
                                       record_field(index, version))
            if found and found != SUBMITTING:
                await self.note(plan.batch_id, "provider_batch_adopted", 1)
                log.info("agent %s v%s of batch %s: its turn is in provider batch %s "
                         "already (submitted by a worker that stopped); waiting on it",
                         index, version, plan.batch_id, found)
                self._submitted.setdefault(found, _Submitted(redis_clock(), None))
                self._watch(lane.client, found, cid, store)
            else:
                if found == SUBMITTING:
                    await self.note(plan.batch_id, "provider_batch_resubmitted", 1)
                    log.warning("agent %s v%s of batch %s: a worker stopped while submitting "
                                "its turn to a provider batch; submitted again (it may be "
                                "paid twice: counted in stat:provider_batch_resubmitted)",
                                index, version, plan.batch_id)
                lane.pending.append((cid, _Turn(store, index, version, request, future,
                                                resubmit=found == SUBMITTING,
                                                cap=size or router.sizes()[0])))
                if lane.flusher is None or lane.flusher.done():
                    lane.flusher = asyncio.create_task(self._flush(lane))
        started = checked = time.monotonic()
        since = redis_clock()
        self._waiting[plan.batch_id] += 1
        try:
            while not future.done():
                if time.monotonic() - started > MAX_WAIT_S:
                    raise BackendTimeout(f"provider batch turn {cid}: no answer after "
                                         f"{MAX_WAIT_S:g}s")
                wait = CANCEL_CHECK_S
                if hedge is not None:
                    sub = self._submitted.get(self._owner_of.get(cid, ""))
                    capped = router.stats["hedge_capped"]
                    at = router.hedge_at(since if sub is None else sub.at, turns_left,
                                         None if sub is None else sub.size,
                                         waiting=self._waiting[plan.batch_id] - 1, turn=cid)
                    if router.stats["hedge_capped"] > capped:  # kept waiting: the sync path
                        self._stats(store).add(plan.batch_id, "hedge_capped")  # is full
                    now = redis_clock()
                    if at is not None and now >= at:
                        return await self._hedge(plan, store, cid, future, hedge,
                                                 (index, version, token))
                    if at is not None:
                        wait = min(max(at - now, 0.01), CANCEL_CHECK_S)
                await asyncio.wait({future}, timeout=wait)
                if not future.done() and time.monotonic() - checked >= CANCEL_CHECK_S:
                    checked = time.monotonic()
                    if await store.cancelled():
                        raise BatchCancelled(f"batch {plan.batch_id} was cancelled")
            return future.result(), True
        finally:
            self._waiting[plan.batch_id] -= 1
            if self._waiting[plan.batch_id] <= 0:
                del self._waiting[plan.batch_id]
            if self._futures.get(cid) is future:
                del self._futures[cid]
            for wanted in self._wanted.values():
                wanted.discard(cid)
            self._owner_of.pop(cid, None)

    async def _hedge(self, plan: BatchPlan, store: BatchStore, cid: str,
                     future: asyncio.Future[ItemResult], hedge: Hedge,
                     turn: tuple[int, int, str]) -> tuple[ItemResult, bool]:
        """Race the waiting turn against the sync API; the first answer is returned (so the
        turn commits once), the loser cancelled (sync) or forgotten (its ``custom_id``).
        ``turn``: (index, version, lease token), which the hedge intent names."""
        self._stats(store).add(plan.batch_id, "batch_hedged")
        # on the batch before the request is sent: a worker killed mid-hedge leaves it
        # counted (``batch_hedged`` minus the ``hedge_won_*`` bounds what was not reported)
        await self._stats(store).settle()
        # and the intent, which a worker that takes the turn over counts if this one dies
        # with the request in flight (``hedge_intent``)
        await self.hedge_intent(store, *turn)
        sync = asyncio.ensure_future(hedge())
        try:
            while True:
                racing: set[asyncio.Future[object]] = {future, sync}  # type: ignore[arg-type]
                await asyncio.wait(racing, timeout=CANCEL_CHECK_S,
                                   return_when=asyncio.FIRST_COMPLETED)
                if future.done() and future.result().ok:
                    self._stats(store).add(plan.batch_id, "hedge_won_by_batch")
                    await self._stats(store).settle()  # on the batch before the turn commits
                    item = future.result()
                    if item.response is not None:  # what the cancelled sync request cost
                        item = ItemResult(cid, response=with_sync_loser(item.response, sync))
                    return item, True
                if sync.done() and not future.done() and sync.exception() is not None:
                    log.warning("turn %s: its hedge to the sync API failed (%s); waiting on "
                                "the provider batch", cid, sync.exception())
                    self._stats(store).add(plan.batch_id, "hedge_failed")
                    return await self._wait_only(plan, store, future), True
                if sync.done() or future.done():
                    break
                if await store.cancelled():
                    raise BatchCancelled(f"batch {plan.batch_id} was cancelled")
            pb = self._owner_of.get(cid)
            if pb is not None and pb in self._submitted:
                self._submitted[pb].answered_sync.add(cid)
            if pb is not None and pb in self._watchers:  # its item is read when pb ends
                self._lost.setdefault(pb, {})[cid] = self._lost_turn(store)
            for wanted in self._wanted.values():
                wanted.discard(cid)  # the batch's answer, if it comes, is dropped
            response = await sync  # a failed batch item: the sync answer (or its error)
            self._stats(store).add(plan.batch_id, "hedge_won_by_sync")
            await self._stats(store).settle()  # on the batch before the turn commits
            return ItemResult(cid, response=response), False
        finally:
            if not sync.done():
                sync.cancel()
                with contextlib.suppress(BaseException):
                    await sync

    @staticmethod
    async def _wait_only(plan: BatchPlan, store: BatchStore,
                         future: asyncio.Future[ItemResult]) -> ItemResult:
        while not future.done():
            await asyncio.wait({future}, timeout=CANCEL_CHECK_S)
            if not future.done() and await store.cancelled():
                raise BatchCancelled(f"batch {plan.batch_id} was cancelled")
        return future.result()

    @staticmethod
    async def hedge_intent(store: BatchStore, index: int, version: int, token: str) -> None:
        """Before this worker sends a turn's sync hedge request (billed, answered or not):
        say so in Redis (``lua/hedge_intent.lua``: ``pbatch`` field ``s:<index>:<version>``
        -> the lease token), one round trip. The commit of the version clears it
        (``forget``). Left by a worker killed with the request in flight, it is counted by
        whoever takes the turn over: the sweep's re-send (``resend.lua``), a duplicate
        delivery's commit (``forget``) or its own hedge (here), as
        ``stat:hedge_sync_paid_unknown``: paid, its tokens not known."""
        if not token:
            return
        try:
            found = await store.s.hedge_intent(
                keys=[store.k.provider_batches, store.k.meta],
                args=[intent_field(index, version), token, RECORD_TTL_MS])
        except Exception:  # the hedge still goes; a kill now would not be counted
            log.warning("batch %s: agent %s v%s: its sync hedge intent could not be recorded "
                        "in Redis", store.batch_id, index, version, exc_info=True)
            return
        if int(found):
            log.warning(_LEFT_BEHIND, store.batch_id, index, version)

    @staticmethod
    async def forget(store: BatchStore, index: int, version: int, token: str = "") -> None:
        """Drop the record of a turn whose next state is committed (or lost to another), and
        its sync hedge intent (``lua/forget.lua``, one round trip): one left by another
        holder of the turn (killed, or its lease lapsed, with its request in flight) is
        counted (``stat:hedge_sync_paid_unknown``) and logged."""
        try:
            found = await store.s.forget(
                keys=[store.k.provider_batches, store.k.meta],
                args=[record_field(index, version), intent_field(index, version), token])
        except Exception:
            return
        if int(found):
            log.warning(_LEFT_BEHIND, store.batch_id, index, version)

    # --- provider batches --------------------------------------------------------------------

    async def _flush(self, lane: _Lane) -> None:
        await asyncio.sleep(WINDOW_S)
        while lane.pending:  # turns that arrive while this one submits go out next
            # a turn answered meanwhile (a hedge won, the batch cancelled) is not sent
            ready = [(cid, t) for cid, t in lane.pending
                     if not t.future.done() and self._futures.get(cid) is t.future]
            lane.pending = []
            chunks, short = split_chunks(ready, lane.client, cap_of=lambda turn: turn[1].cap)
            for chunk in chunks:
                await self._submit(lane.client, chunk)
            if short:  # too few for the provider's minimum: the sync API, counted per batch
                stats = self._stats(short[0][1].store)
                for batch_id, n in Counter(t.store.batch_id for _, t in short).items():
                    stats.add(batch_id, "provider_batch_below_min", n)
                await stats.settle()  # counted before the turns fall back
                self._resolve({cid: below_min(cid, len(short), lane.client)
                               for cid, _ in short})

    async def _submit(self, client: ProviderBatchClient, chunk: list[tuple[str, _Turn]]) -> None:
        """Record the turns as being submitted and count the submission, then submit, then
        record the provider batch id for each turn: a worker killed at any point leaves a
        record that says what its re-sent turns must do, and a count that covers it."""
        per_batch: dict[str, list[_Turn]] = {}
        for _, turn in chunk:
            per_batch.setdefault(turn.store.batch_id, []).append(turn)
        try:
            await self._claim_records(per_batch)
            await self._count_submit(per_batch)
            state = await client.submit([(cid, t.request) for cid, t in chunk])
        except Exception as exc:  # every turn of it falls back to the sync API, said so
            log.warning("a provider batch of %d turns could not be submitted: %s",
                        len(chunk), exc)
            for batch_id in per_batch:
                await self.note(batch_id, "provider_batch_submit_failed", 1)
            self._resolve({cid: ItemResult(cid, error=ItemError(
                "server_error", f"the provider batch could not be submitted: {exc}"))
                for cid, _ in chunk})
            return
        try:
            await self._record(per_batch, state.id)
        except Exception:  # the turns still get their answers here; a re-send resubmits
            log.warning("provider batch %s: its turns could not be recorded in Redis",
                        state.id, exc_info=True)
        self._submitted[state.id] = _Submitted(redis_clock(), len(chunk),
                                               {cid for cid, _ in chunk})
        for cid, turn in chunk:
            self._watch(client, state.id, cid, turn.store)
            if self._futures.get(cid) is not turn.future:  # answered (a hedge won) while
                self._wanted[state.id].discard(cid)  # the submit was under way: maybe billed
                self._lost.setdefault(state.id, {})[cid] = self._lost_turn(turn.store)

    def _lost_turn(self, store: BatchStore) -> _Lost:
        """A turn of ``store``'s batch the sync API answered, whose provider batch may bill it."""
        return _Lost(store, *self._bill_terms.get(store.batch_id, (None, None)))

    @staticmethod
    async def _count_submit(per_batch: dict[str, list[_Turn]]) -> None:
        """``stat:provider_batches`` and ``stat:provider_batch_items`` of each batch the
        submit holds turns of, at once (readers compare them with the provider's count right
        away) and in one round trip."""
        first = next(iter(per_batch.values()))[0].store
        async with first.r.pipeline(transaction=True) as pipe:
            for turns in per_batch.values():
                meta = turns[0].store.k.meta
                await first.s.note(keys=[meta], args=["stat:provider_batches", 1],
                                   client=pipe)
                await first.s.note(keys=[meta], args=["stat:provider_batch_items", len(turns)],
                                   client=pipe)
            await pipe.execute()

    async def _claim_records(self, per_batch: dict[str, list[_Turn]]) -> None:
        """Record the turns as being submitted. A record already there that this process did
        not read when the turn arrived is another worker's submit of the same turn (a live
        turn re-sent after its lease lapsed, both in their windows at once): the turn is
        paid twice, so it is counted (``stat:provider_batch_resubmitted``). HSETNX makes
        exactly one of two racing workers the first."""
        for batch_id, turns in per_batch.items():
            store = turns[0].store
            pipe = store.r.pipeline(transaction=False)
            for t in turns:
                pipe.hsetnx(store.k.provider_batches, record_field(t.index, t.version),
                            SUBMITTING)
            pipe.pexpire(store.k.provider_batches, RECORD_TTL_MS)
            created = (await pipe.execute())[:-1]
            again = [t for t, new in zip(turns, created, strict=True) if not new]
            if again:  # the record is ours from now (the other submit keeps its answer)
                await self._record({batch_id: again}, SUBMITTING)
            twice = [t for t in again if not t.resubmit]
            if twice:
                await self.note(batch_id, "provider_batch_resubmitted", len(twice))
                log.warning("batch %s: %d turns were in another worker's provider batch "
                            "submit already (re-sent while live); submitted again (counted "
                            "in stat:provider_batch_resubmitted)", batch_id, len(twice))

    @staticmethod
    async def _record(per_batch: dict[str, list[_Turn]], value: str) -> None:
        for turns in per_batch.values():
            store = turns[0].store
            pipe = store.r.pipeline(transaction=False)
            pipe.hset(store.k.provider_batches, mapping={
                record_field(t.index, t.version): value for t in turns})
            pipe.pexpire(store.k.provider_batches, RECORD_TTL_MS)
            await pipe.execute()

    def _watch(self, client: ProviderBatchClient, batch_id: str, cid: str,
               owner: BatchStore) -> None:
        self._wanted.setdefault(batch_id, set()).add(cid)
        self._owner_of[cid] = batch_id
        self._owners.setdefault(batch_id, {})[owner.batch_id] = owner
        if batch_id not in self._watchers or self._watchers[batch_id].done():
            task = asyncio.create_task(self._poll(client, batch_id))
            self._watchers[batch_id] = task
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _poll(self, client: ProviderBatchClient, batch_id: str) -> None:
        """Poll one provider batch until it ends, then hand each waiting turn its result
        (again for turns that came to wait on it meanwhile), until nobody here waits. One
        that nobody waits on any more before it ends is cancelled at the provider when every
        agentbatch batch it holds turns of was cancelled, or when the sync API answered all
        its turns (hedges won); not when a worker is stopping: the turns it leaves are
        re-sent, and wait on it again elsewhere. Polled on for the bill of turns the sync API
        answered only, it is given up at ``_bill_until`` (``_bill_unknown``)."""
        delay = POLL_S
        polled_from = time.monotonic()
        ended = cancelled = False
        give_up: float | None = None  # Redis clock: while polled only for the bill
        try:
            while True:
                wanted = sorted(self._wanted.get(batch_id, ()))
                if wanted:
                    give_up = None
                else:
                    sub = self._submitted.get(batch_id)
                    hedged = sub is not None and bool(sub.members) \
                        and sub.members <= sub.answered_sync
                    if not ended and not cancelled and (
                            hedged or await self._all_cancelled(batch_id)):
                        await self._cancel(client, batch_id, "the sync API answered its turns"
                                           if hedged else "its batches were cancelled")
                        cancelled = True
                        if sub is not None:  # polled on for its bill only: no latency to
                            sub.size = None  # observe, nothing running for the routers
                    if ended or not self._lost.get(batch_id):
                        return
                    # turns the sync API answered: polled on until it has ended, for its
                    # bill, within a bound
                    if give_up is None:
                        give_up = self._bill_until(batch_id)
                    if redis_clock() >= give_up:
                        await self._bill_unknown(batch_id, self._lost.pop(batch_id, {}),
                                                 "it had not ended by the later of its "
                                                 "batches' deadline and "
                                                 f"{CLOSE_BILL_S:g}s after no turn here "
                                                 "waited on it")
                        return
                state = None
                with contextlib.suppress(BackendError):
                    state = await client.state(batch_id)
                if state is None or not state.ended:
                    wait = delay if give_up is None else \
                        min(delay, max(give_up - redis_clock(), 0.01))
                    await asyncio.sleep(wait)
                    # every POLL_SHARE of the batch's age (an answer is seen ~10% late, not
                    # up to 50% as with a 1.5x backoff), within POLL_S..MAX_POLL_S
                    age = time.monotonic() - polled_from
                    delay = min(max(POLL_SHARE * age, POLL_S), MAX_POLL_S)
                    continue
                if not ended:
                    await self._observe(batch_id)
                ended = True
                lost = self._lost.pop(batch_id, {})
                try:
                    found = await client.results(batch_id, wanted + sorted(lost))
                except Exception as exc:
                    found = {cid: ItemResult(cid, error=ItemError(
                        "server_error", f"provider batch {batch_id} ({state.status}): {exc}"))
                        for cid in wanted}
                    if lost:
                        await self._bill_unknown(batch_id, lost,
                                                 f"its items could not be read ({exc})")
                        lost = {}
                await self._pay_lost(batch_id, lost, {
                    cid: found.pop(cid) for cid in lost if cid in found})
                failed = sum(not item.ok for item in found.values())
                if failed:
                    log.warning("provider batch %s ended %s with %d of %d turns unanswered",
                                batch_id, state.status, failed, len(found))
                self._resolve(found)
                self._wanted.get(batch_id, set()).difference_update(wanted)
        finally:
            self._wanted.pop(batch_id, None)
            self._owners.pop(batch_id, None)
            self._watchers.pop(batch_id, None)
            self._submitted.pop(batch_id, None)
            self._lost.pop(batch_id, None)

    def _bill_until(self, batch_id: str) -> float:
        """Until when (Redis clock) a provider batch nobody here waits on is polled for the
        bill of its turns the sync API answered: the later of their batches' deadline and
        ``CLOSE_BILL_S`` from now, as the embedded engine waits (``batch_turns``). A cancel
        takes effect at once (the simulator) or within minutes (OpenAI); one stuck, or a
        provider batch left running, is not polled until the provider's 24 h expiry."""
        deadlines = [lost.deadline for lost in self._lost.get(batch_id, {}).values()
                     if lost.deadline is not None]
        return max([redis_clock() + CLOSE_BILL_S, *deadlines])

    async def _bill_unknown(self, batch_id: str, lost: dict[str, _Lost], why: str) -> None:
        """What provider batch ``batch_id`` billed for ``lost`` turns (the sync API answered
        them) is not known: said, and counted per agentbatch batch
        (``stat:hedge_lost_batch_unknown``), never silent."""
        if not lost:
            return
        log.warning("provider batch %s: given up on its bill: %s; what it bills for %d turns "
                    "the sync API answered is not known (stat:hedge_lost_batch_unknown)",
                    batch_id, why, len(lost))
        for owner, n in Counter(turn.store.batch_id for turn in lost.values()).items():
            try:
                await self.note(owner, "hedge_lost_batch_unknown", n)
            except Exception:
                log.warning("batch %s: could not count %d turns whose provider batch bill is "
                            "not known", owner, n, exc_info=True)

    async def _pay_lost(self, batch_id: str, lost: dict[str, _Lost],
                        found: dict[str, ItemResult]) -> None:
        """The items of turns the sync API answered, read when their provider batch ended:
        an answered one was billed at the batch prices. Per agentbatch batch, its cost is
        added to meta's ``spend`` and counted (``lua/pay_lost.lua``, atomic, at once: the
        next claim's cap check sees it); in no result's ``cost_usd``."""
        per_batch: dict[str, tuple[_Lost, list[Usage]]] = {}
        for cid, item in found.items():
            turn = lost.get(cid)
            if turn is not None and item.response is not None:
                per_batch.setdefault(turn.store.batch_id, (turn, []))[1].append(
                    item.response.usage)
        for owner, (turn, usages) in per_batch.items():
            usage = sum(usages, Usage())
            spend = "" if turn.prices is None else \
                repr(cost_usd(usage, turn.prices, batch=True))
            try:
                await turn.store.s.pay_lost(keys=[turn.store.k.meta], args=[
                    spend, len(usages), usage.prompt_tokens, usage.completion_tokens])
            except Exception:
                log.warning("batch %s: provider batch %s billed %d turns the sync API had "
                            "answered; could not add it to the spend", owner, batch_id,
                            len(usages), exc_info=True)
                continue
            log.info("batch %s: provider batch %s billed %d turns the sync API had answered "
                     "(%d prompt, %d completion tokens): added to the spend", owner, batch_id,
                     len(usages), usage.prompt_tokens, usage.completion_tokens)

    async def _observe(self, batch_id: str) -> None:
        """A provider batch submitted here has ended: its latency, for its batches' routers
        here and, through Redis, the fleet's (an adopted one's submit time is not known)."""
        sub = self._submitted.get(batch_id)
        if sub is None or sub.size is None:
            return
        seconds = redis_clock() - sub.at
        owners = self._owners.get(batch_id, {})
        for owner in owners:
            router = self._routers.get(owner)
            if router is not None:
                router.batch_latency.add(seconds, sub.size)
        await self._share(list(owners.values()), seconds, sub.size)

    async def _all_cancelled(self, batch_id: str) -> bool:
        try:
            return all([await store.cancelled()
                        for store in self._owners.get(batch_id, {}).values()])
        except Exception:  # Redis unreachable: leave the provider batch be
            return False

    async def _cancel(self, client: ProviderBatchClient, batch_id: str, why: str) -> None:
        log.info("cancelling provider batch %s: %s", batch_id, why)
        stats = None
        for owner, store in self._owners.get(batch_id, {}).items():
            stats = self._stats(store)
            stats.add(owner, "provider_batches_cancelled")
        if stats is not None:
            await stats.settle()  # counted before the provider sees the cancel
        try:
            await wait_for(client.cancel(batch_id), timeout=60)
        except Exception as exc:
            log.warning("provider batch %s could not be cancelled: %s", batch_id, exc)

    def _resolve(self, items: dict[str, ItemResult]) -> None:
        for cid, item in items.items():
            future = self._futures.get(cid)
            if future is not None and not future.done():
                future.set_result(item)


def item_error(item: ItemResult, why: str = "") -> BackendError:
    """The error a turn whose provider batch item failed ends with (when no sync fallback;
    ``why`` says why not)."""
    error = item.error or ItemError("missing", "no result")
    kind = BadRequest if error.kind == "bad_request" else ServerError
    return kind(f"provider batch turn {error.kind}: {error.message}{why}")
