"""Turns through a provider's batch API (``pricing="batch"`` / ``"auto"``), embedded engine.

Turns ready within ``WINDOW_S`` of each other go out as provider batches of at most
``MAX_ITEMS`` turns each; a watcher polls each one and hands each turn its result, matched
by ``custom_id``. The caller (``call_model``) then commits the reply exactly as a sync one,
through the state machine's ``step``.

Why small provider batches: a provider batch answers only when it has ended, i.e. when its
slowest request is done (OpenAI's output file, Anthropic's ``results_url``; the simulator
models each request's latency as log-normal and the batch as their maximum). One provider
batch for every ready turn made all agents move in lock-step, each round waiting for the
slowest of ~1,000 requests (about 5x the median). With a few turns per provider batch, a
slow request holds only its own batch, and agents move on independently. This assumes the
provider finishes a small batch sooner than a big one, as the simulator does; a provider
whose batch latency is all queueing would gain nothing from it (and lose nothing but polls).

``"auto"`` routing and the hedge time are ``batch_routing.Router``'s (shared with the
distributed engine). Hedging (``complete``): a turn still waiting at the router's hedge time
is sent to the sync API as well. The first answer is returned, so it is committed once; the
loser is cancelled (sync) or dropped (nobody waits on its ``custom_id`` any more), and a
provider batch none of whose turns is still waited on is cancelled.

A provider bills every request of a batch that completed, even in a batch cancelled later.
So the ``custom_id`` of a turn whose sync hedge won is kept (``_Open.lost``) until its batch
ends (or, cancelled, has ended), and its item is read with the others': an answer there was
paid at the batch prices, and is added to the batch's spend (``lost_usage``, in
``progress().cost_usd``, and ``Budget.spent``, which the caps read) and counted
(``hedge_lost_batch_paid``, ``hedge_lost_batch_paid_prompt_tokens`` / ``_completion_tokens``).
It is in no result's ``cost_usd``: its agent has moved on, and may have ended already. A
request not completed when its batch was cancelled (or expired, or failed) was not paid.

A turn whose provider batch failed or expired goes to the sync API while the deadline
allows, logged; else it fails with an error that says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from agentbatch.backends.base import Backend
from agentbatch.backends.provider_batch import ItemError, ItemResult, ProviderBatchClient
from agentbatch.core.budget import Budget
from agentbatch.core.errors import (
    BackendError,
    BackendTimeout,
    BadRequest,
    RateLimited,
    ServerError,
)
from agentbatch.core.model_io import ModelRequest, ModelResponse, Usage
from agentbatch.core.pricing import cost_usd
from agentbatch.core.wait_for import wait_for
from agentbatch.metrics import record_hedge_loser_tokens
from agentbatch.turnloop.batch_routing import (
    DEFAULT_MAX_ITEMS,
    ROUTE_Q,
    SAFETY_S,
    WINDOW_S,
    Latencies,
    Route,
    Router,
    SyncThroughput,
)

log = logging.getLogger(__name__)

__all__ = ["MAX_ITEMS", "SAFETY_S", "WINDOW_S", "ProviderBatchTurns"]

T = TypeVar("T")
MAX_ITEMS = DEFAULT_MAX_ITEMS  # turns per provider batch: a slow request holds only these few
HTTP_AT_ONCE = 4  # batch API calls in flight (submits, polls): self-clocked by the server
POLL_S = 0.25  # a first poll backing off 1.5x to MAX_POLL_S (the distributed engine's)
MAX_POLL_S = 5.0
WATCH_MIN_S = 0.5  # here a provider batch is polled every POLL_SHARE of its age, within
POLL_SHARE = 0.1  # WATCH_MIN_S..WATCH_MAX_S: an answer is seen at most ~10% late, and a
WATCH_MAX_S = 30.0  # long batch is not polled often
MAX_WAIT_S = 25 * 3600.0  # without a deadline: past the providers' 24 h window
CLOSE_BILL_S = 10.0  # at close, how long a cancelled batch is awaited for its hedged turns' bill


@dataclass
class _Open:
    """A provider batch still being watched."""

    id: str
    submitted: float
    wanted: set[str]
    size: int = 0  # turns it was submitted with
    # turns answered elsewhere (a sync hedge won) whose item the provider may still bill:
    # read when the batch has ended (``ProviderBatchTurns._pay_lost``)
    lost: set[str] = field(default_factory=set)
    cancelled: bool = False  # cancelled by this process (once)


_KINDS: dict[str, type[BackendError]] = {
    "server_error": ServerError, "rate_limited": RateLimited, "bad_request": BadRequest,
    "expired": BackendTimeout, "cancelled": ServerError, "missing": ServerError}


def split_chunks(ready: list[T], client: object,
                 cap_of: Callable[[T], int] | None = None) -> tuple[list[list[T]], list[T]]:
    """``ready`` turns as provider batches of the client's size: at most ``max_items``
    (``MAX_ITEMS`` unless the provider needs bigger), at least ``min_items`` (Bedrock's
    per-job minimum). With ``cap_of``, a turn goes in a batch of at most its cap turns
    (``Router.pick_size``: a turn the deadline presses goes in a small, sooner batch): the
    turns are taken smallest cap first, and a batch is full at its first turn's cap. A
    short tail joins the previous chunk when that stays within ``max_items``; what still
    falls short is returned apart, for the sync API."""
    size = max(int(getattr(client, "max_items", MAX_ITEMS)), 1)
    least = max(int(getattr(client, "min_items", 1)), 1)
    if cap_of is None:
        chunks = [ready[at:at + size] for at in range(0, len(ready), size)]
    else:
        def cap(turn: T) -> int:
            return min(max(cap_of(turn), least), size)

        chunks = []
        for turn in sorted(ready, key=cap):
            if not chunks or len(chunks[-1]) >= cap(chunks[-1][0]):
                chunks.append([turn])
            else:
                chunks[-1].append(turn)
    if len(chunks) >= 2 and len(chunks[-1]) < least and len(chunks[-2]) + len(chunks[-1]) <= size:
        chunks[-2] += chunks.pop()
    short = chunks.pop() if chunks and len(chunks[-1]) < least else []
    return chunks, short


def with_sync_loser(reply: ModelResponse, sync: asyncio.Future[Any]) -> ModelResponse:
    """The provider batch's ``reply`` to a hedged turn, carrying what its losing request to
    the sync API was paid (``ModelResponse.hedge_usage``, priced into ``cost_usd`` and the
    spend at the sync prices), as ``backends/hedge.py`` does for a pool's hedge: exact when
    the sync request answered too, else its prompt (the batch reply's: the same request),
    since it was sent and is being cancelled; nothing when it failed (an error is not
    billed). Both engines' hedges return this when the batch wins."""
    if sync.done() and (sync.cancelled() or sync.exception() is not None):
        return reply
    lost = (sync.result().usage if sync.done()
            else Usage(prompt_tokens=reply.usage.prompt_tokens))
    record_hedge_loser_tokens(lost.prompt_tokens, lost.completion_tokens)
    return reply.model_copy(update={"hedge_usage": (reply.hedge_usage or Usage()) + lost})


def below_min(cid: str, ready: int, client: object) -> ItemResult:
    """The answer for a turn that had too few companions to make a provider batch: a
    retryable error, so the turn goes to the sync API while the deadline allows (counted
    ``provider_batch_below_min``)."""
    least = getattr(client, "min_items", 1)
    return ItemResult(cid, error=ItemError(
        "server_error", f"{ready} turns were ready together, fewer than the {least} a "
        "provider batch of this backend takes"))


class ProviderBatchTurns:
    """The provider-batch side of one embedded batch."""

    def __init__(self, client: ProviderBatchClient, backend: Backend, *,
                 mode: Literal["batch", "auto"], deadline: float | None, total: int,
                 concurrency: int = 1, route_q: float = ROUTE_Q) -> None:
        self.client = client
        self.backend = backend
        self.mode = mode
        self.total = total
        # ``concurrency``: the engine's in-flight cap, what the sync path runs at once
        self.router = Router(mode, deadline, total, running=self._running,  # monotonic
                             concurrency=concurrency, route_q=route_q)
        self.router.max_items = int(getattr(client, "max_items", MAX_ITEMS))
        self.router.min_items = int(getattr(client, "min_items", 1))
        self.stats = self.router.stats  # what routing and the batches did, one counter
        # turns waiting for the window: (custom_id, request, the batch size it may go in)
        self._pending: list[tuple[str, ModelRequest, int]] = []
        self._futures: dict[str, asyncio.Future[ItemResult]] = {}
        self._owner: dict[str, _Open] = {}
        self._open: dict[str, _Open] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._flusher: asyncio.Task[None] | None = None
        self._ids = itertools.count()
        self._http = asyncio.Semaphore(HTTP_AT_ONCE)  # many small batches: bounded calls
        # what provider batches billed for turns the sync API answered (``_pay_lost``)
        self.lost_usage = Usage()
        self.budget: Budget | None = None  # the batch's (set by its engine): caps see it

    # --- routing (batch_routing.Router) ------------------------------------------------------

    @property
    def deadline(self) -> float | None:
        """The batch's deadline, ``time.monotonic()``."""
        return self.router.deadline

    @deadline.setter
    def deadline(self, value: float | None) -> None:
        self.router.deadline = value

    @property
    def batch_latency(self) -> Latencies:
        return self.router.batch_latency

    @property
    def sync_latency(self) -> Latencies:
        return self.router.sync_latency

    @property
    def sync_path(self) -> SyncThroughput:
        return self.router.sync_path

    def _running(self) -> list[tuple[float, int]]:
        now = time.monotonic()
        return [(now - o.submitted, o.size) for o in self._open.values()
                if not o.cancelled]  # one cancelled is watched only for its bill

    def batch_estimate(self, q: float = 0.9) -> float | None:
        return self.router.batch_estimate(q)

    def sync_estimate(self, ahead: int | None = None) -> float:
        return self.router.sync_estimate(ahead)

    def route(self, turns_left: float, live: int) -> Route:
        """Where the next turn of an agent with ``turns_left`` (estimated) turns goes."""
        return self.router.route(turns_left, live)

    def route_sized(self, turns_left: float, live: int) -> tuple[Route, int]:
        """``route``, and for the batch API the provider batch size the turn may go in
        (``Router.decide``; ``complete``'s ``size``)."""
        where, _, size = self.router.decide(turns_left, live)
        return where, size

    def _hedge_at(self, cid: str, submitted: float, turns_left: float,
                  size: int | None) -> float | None:
        """When a waiting batch turn should race the sync API (``Router.hedge_at``; the
        other batch turns waiting would hedge with it). ``cid`` names the turn, so a turn the
        hedge cap holds back is counted once (``hedge_capped``), not once per batch."""
        return self.router.hedge_at(submitted, turns_left, size,
                                    waiting=len(self._futures) - 1, turn=cid)

    # --- the two paths ---------------------------------------------------------------------

    async def sync(self, request: ModelRequest) -> ModelResponse:
        """One turn routed to the sync API (``route``), its latency observed."""
        with self.router.timed_sync(routed=True):
            return await self.backend.complete(request)

    async def _sync(self, request: ModelRequest) -> ModelResponse:
        """One request to the sync API; its latency and the sync path's throughput observed."""
        with self.router.timed_sync():
            return await self.backend.complete(request)

    async def complete(self, request: ModelRequest, turns_left: float,
                       size: int | None = None) -> tuple[ModelResponse, bool]:
        """The reply to ``request`` and whether the provider batch served it (else sync);
        ``size``: the provider batch size it may go in (``route_sized``; None: full)."""
        cid = f"t{next(self._ids)}-{request.request_id or 'turn'}"[:64]
        future: asyncio.Future[ItemResult] = asyncio.get_running_loop().create_future()
        self._futures[cid] = future
        self._pending.append((cid, request, size or self.router.sizes()[0]))
        self.stats["batch_sent"] += 1
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        submitted = time.monotonic()
        try:
            while not future.done():
                opened = self._owner.get(cid)  # p90s run from a batch's submit, not the window
                at = self._hedge_at(cid, submitted if opened is None else opened.submitted,
                                    turns_left, None if opened is None else opened.size)
                now = time.monotonic()
                if at is not None and now >= at:
                    return await self._hedge(cid, request, future)
                wait = 1.0 if at is None else min(max(at - now, 0.01), 1.0)
                await asyncio.wait({future}, timeout=wait)
            return await self._settle(cid, request, future.result())
        finally:
            self._forget(cid)

    async def _hedge(self, cid: str, request: ModelRequest,
                     future: asyncio.Future[ItemResult]) -> tuple[ModelResponse, bool]:
        self.stats["hedged"] += 1
        sync = asyncio.ensure_future(self._sync(request))
        try:
            racing: set[asyncio.Future[Any]] = {future, sync}
            await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
            if future.done() and future.result().ok:
                self.stats["hedge_won_by_batch"] += 1
                reply, by_batch = await self._settle(cid, request, future.result())
                return with_sync_loser(reply, sync), by_batch
            self._forget(cid, lost=True)  # its answer, if it comes, is dropped (and paid)
            response = await sync
            self.stats["hedge_won_by_sync"] += 1
            self.stats["served_sync"] += 1
            return response, False
        finally:
            if not sync.done():
                sync.cancel()
                with contextlib.suppress(BaseException):
                    await sync

    async def _settle(self, cid: str, request: ModelRequest,
                      item: ItemResult) -> tuple[ModelResponse, bool]:
        if item.response is not None:
            self.stats["served_batch"] += 1
            return item.response, True
        error = item.error or ItemError("missing", "no result")
        if error.retryable and self.router.allows_sync():
            self.stats["fallback_sync"] += 1
            log.warning("a provider batch turn came back %s (%s): sent to the sync API",
                        error.kind, error.message)
            response = await self._sync(request)
            self.stats["served_sync"] += 1
            return response, False
        why = "" if not error.retryable else "; the deadline left no time for the sync API"
        raise _KINDS[error.kind](f"provider batch turn {error.kind}: {error.message}{why}")

    # --- provider batches ------------------------------------------------------------------

    async def _flush(self) -> None:
        await asyncio.sleep(WINDOW_S)
        ready = [turn for turn in self._pending if turn[0] in self._futures]
        self._pending = []
        chunks, short = split_chunks(ready, self.client, cap_of=lambda turn: turn[2])
        for chunk in chunks:  # submitted side by side: a round of small batches goes out at once
            self._spawn(self._submit([(cid, req) for cid, req, _ in chunk]))
        if short:
            self.stats["provider_batch_below_min"] += len(short)
            self._resolve({cid: below_min(cid, len(short), self.client)
                           for cid, _, _ in short})

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _submit(self, chunk: list[tuple[str, ModelRequest]]) -> None:
        try:
            async with self._http:
                state = await self.client.submit(chunk)
        except Exception as exc:  # every turn of it falls back or fails, said so
            log.warning("a provider batch of %d turns could not be submitted: %s",
                        len(chunk), exc)
            self._resolve({cid: ItemResult(cid, error=ItemError(
                "server_error", f"the provider batch could not be submitted: {exc}"))
                for cid, _ in chunk})
            return
        opened = _Open(state.id, time.monotonic(), {cid for cid, _ in chunk}, len(chunk))
        # a turn answered elsewhere while the submit was under way: sent, so maybe billed
        opened.lost = {cid for cid in opened.wanted if cid not in self._futures}
        opened.wanted -= opened.lost
        self.stats["provider_batches"] += 1
        self._open[state.id] = opened
        for cid in opened.wanted:
            self._owner[cid] = opened
        await self._watch(opened)

    async def _watch(self, opened: _Open) -> None:
        give_up = (self.deadline if self.deadline is not None
                   else opened.submitted + MAX_WAIT_S)
        try:
            while True:
                if not opened.wanted:  # every turn answered elsewhere: stop paying for it
                    await self._cancel(opened, "its turns were all answered by the sync API")
                    await self._pay_lost(opened, max(give_up, time.monotonic() + CLOSE_BILL_S))
                    return
                state = None
                with contextlib.suppress(BackendError):
                    async with self._http:
                        state = await self.client.state(opened.id)
                if state is not None and state.ended:
                    break
                if time.monotonic() >= give_up:
                    await self._cancel(opened, "it was still running at the deadline")
                    self._resolve({cid: ItemResult(cid, error=ItemError(
                        "expired", f"provider batch {opened.id} was still running at the "
                        "deadline")) for cid in list(opened.wanted)})
                    await self._pay_lost(opened, time.monotonic() + CLOSE_BILL_S)
                    return
                now = time.monotonic()
                delay = min(max(POLL_SHARE * (now - opened.submitted), WATCH_MIN_S), WATCH_MAX_S)
                await asyncio.sleep(min(delay, max(give_up - now, 0.01)))
            lost = sorted(opened.lost)
            try:
                async with self._http:
                    found = await self.client.results(opened.id,
                                                      sorted(opened.wanted) + lost)
            except Exception as exc:
                found = {cid: ItemResult(cid, error=ItemError(
                    "server_error", f"provider batch {opened.id} ({state.status}): {exc}"))
                    for cid in [*opened.wanted, *lost]}
                if lost:
                    log.warning("provider batch %s: its items for %d turns the sync API "
                                "answered could not be read; what they were billed is not "
                                "known", opened.id, len(lost))
            self._count_lost(opened, {cid: found.pop(cid) for cid in lost if cid in found})
            if any(item.ok for item in found.values()):
                self.batch_latency.add(time.monotonic() - opened.submitted, opened.size)
            failed = sum(not item.ok for item in found.values())
            if failed:
                log.warning("provider batch %s ended %s with %d of %d turns unanswered",
                            opened.id, state.status, failed, len(found))
            self._resolve(found)
        finally:
            self._open.pop(opened.id, None)

    async def _pay_lost(self, opened: _Open, until: float) -> None:
        """After a cancel: wait (until ``until``, monotonic) for the batch to have ended,
        then read the items of its turns the sync API answered (``_count_lost``). A
        provider's cancel takes effect at once (the simulator) or within minutes (OpenAI)."""
        if not opened.lost:
            return
        state, delay = None, POLL_S
        while True:
            with contextlib.suppress(BackendError):
                async with self._http:
                    state = await self.client.state(opened.id)
            if state is not None and state.ended:
                break
            now = time.monotonic()
            if now >= until:
                log.warning("provider batch %s had not ended when given up on: what it bills "
                            "for %d turns the sync API answered is not known",
                            opened.id, len(opened.lost))
                return
            await asyncio.sleep(min(delay, max(until - now, 0.01)))
            delay = min(delay * 1.5, MAX_POLL_S)
        lost = sorted(opened.lost)
        try:
            async with self._http:
                found = await self.client.results(opened.id, lost)
        except Exception as exc:
            log.warning("provider batch %s: its items for %d turns the sync API answered "
                        "could not be read (%s); what they were billed is not known",
                        opened.id, len(lost), exc)
            return
        self._count_lost(opened, found)

    def _count_lost(self, opened: _Open, found: dict[str, ItemResult]) -> None:
        """Items of ``opened``'s lost turns: those answered were billed by the provider at
        the batch prices. Added to the batch's spend (``lost_usage``: ``progress().cost_usd``
        reads it; ``Budget.spent``: the caps do) and counted; in no result's ``cost_usd``
        (the agent has moved on)."""
        opened.lost.clear()  # read once: never counted twice
        paid = [item.response.usage for item in found.values() if item.response is not None]
        if not paid:
            return
        usage = sum(paid, Usage())
        self.lost_usage = self.lost_usage + usage
        self.stats["hedge_lost_batch_paid"] += len(paid)
        self.stats["hedge_lost_batch_paid_prompt_tokens"] += usage.prompt_tokens
        self.stats["hedge_lost_batch_paid_completion_tokens"] += usage.completion_tokens
        if self.budget is not None and self.budget.prices is not None:
            self.budget.spent += cost_usd(usage, self.budget.prices, batch=True)
        log.info("provider batch %s billed %d turns the sync API had answered (%d prompt, "
                 "%d completion tokens): added to the batch's spend", opened.id, len(paid),
                 usage.prompt_tokens, usage.completion_tokens)

    async def _cancel(self, opened: _Open, why: str) -> None:
        if opened.cancelled:
            return
        opened.cancelled = True
        self.stats["provider_batches_cancelled"] += 1
        log.info("cancelling provider batch %s: %s", opened.id, why)
        try:
            await wait_for(self.client.cancel(opened.id), timeout=60)
        except Exception as exc:
            log.warning("provider batch %s could not be cancelled: %s", opened.id, exc)

    def _resolve(self, items: dict[str, ItemResult]) -> None:
        for cid, item in items.items():
            future = self._futures.get(cid)
            if future is not None and not future.done():
                future.set_result(item)

    def _forget(self, cid: str, *, lost: bool = False) -> None:
        """Nobody waits on ``cid`` any more; ``lost``: the sync API answered it, so its item
        is still read when its batch ends, for what the provider billed."""
        self._futures.pop(cid, None)
        opened = self._owner.pop(cid, None)
        if opened is not None:
            opened.wanted.discard(cid)
            if lost:
                opened.lost.add(cid)

    async def aclose(self) -> None:
        """Stop watching; cancel provider batches still open (nothing waits on them)."""
        still_open = list(self._open.values())
        tasks = list(self._tasks)
        for task in [self._flusher, *tasks]:
            if task is not None and not task.done():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for opened in still_open:
            await self._cancel(opened, "the batch has ended")
        until = time.monotonic() + CLOSE_BILL_S
        await asyncio.gather(*(self._pay_lost(o, until) for o in still_open),
                             return_exceptions=True)
        self._open.clear()
        await self.client.aclose()
