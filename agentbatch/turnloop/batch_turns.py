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

``"auto"`` (``route``): a turn goes to the batch API while the agent's projected finish --
this turn at the ``ROUTE_Q`` (p90) batch latency, its remaining turns at the sync latency --
stays inside the deadline, or while the sync API would not finish the turn sooner (a sync
path backed up past a batch round gains the deadline nothing); else to the sync API. The
quantiles count the provider batches still open as censored at their age (``Latencies``):
the first to end are the fast ones. The sync latency is measured, not assumed: the first turn
``"auto"`` routes goes to the sync API (a probe; ``PRIOR_SYNC_S`` stands in until it
answers). At the batch's tail (at most ``TAIL_SHARE`` of its agents still running) an agent's
last estimated turn goes to the sync API: nobody waits a batch round for it.

A sync turn is not one request's latency when many are sent at once: they queue (inference
slots, the client's in-flight cap, the server). So a sync turn is estimated from the sync
path's backlog -- turns routed to it not yet answered, plus, for a hedge, the batch turns
waiting that would hedge with it -- divided by its observed throughput (``SyncThroughput``:
turns answered per second while it was busy, decayed over ``RATE_TAU_S`` busy seconds, with a
prior of one request at a time at the measured latency). bench_cost.py at 1.1x the all-batch
wall, at load 28: turns routed and hedged at the one-request estimate (~50 ms) left 827 of
1,000 agents past a deadline the all-batch run met. A turn routed to the sync API but refused
before its request (a budget cap) stays counted: the estimate errs late, the safe side.

Hedging (``complete``): with a deadline, a turn still waiting when its remaining turns would
only just fit before the deadline on the sync API is sent to the sync API as well (earlier
would pay the sync price for nothing the deadline needs). Without one, a turn is hedged
past the observed p90 latency of provider batches of a similar size (a batch ends with its
slowest request). The first answer is returned, so it is committed once; the loser is
cancelled (sync) or dropped (its ``custom_id`` is forgotten), and a provider batch none of
whose turns is still waited on is cancelled.

A turn whose provider batch failed or expired goes to the sync API while the deadline
allows, logged; else it fails with an error that says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
from collections import Counter
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from agentbatch.backends.base import Backend
from agentbatch.backends.provider_batch import ItemError, ItemResult, ProviderBatchClient
from agentbatch.core.errors import (
    BackendError,
    BackendTimeout,
    BadRequest,
    RateLimited,
    ServerError,
)
from agentbatch.core.model_io import ModelRequest, ModelResponse

log = logging.getLogger(__name__)

Route = Literal["sync", "batch"]
WINDOW_S = 0.25  # turns ready this close together share one provider batch
MAX_ITEMS = 8  # turns per provider batch: a slow request holds only these few
HTTP_AT_ONCE = 4  # batch API calls in flight (submits, polls): self-clocked by the server
POLL_S = 0.25  # a first poll backing off 1.5x to MAX_POLL_S (the distributed engine's)
MAX_POLL_S = 5.0
WATCH_MIN_S = 0.5  # here a provider batch is polled every POLL_SHARE of its age, within
POLL_SHARE = 0.1  # WATCH_MIN_S..WATCH_MAX_S: an answer is seen at most ~10% late, and a
WATCH_MAX_S = 30.0  # long batch is not polled often
MAX_WAIT_S = 25 * 3600.0  # without a deadline: past the providers' 24 h window
PRIOR_SYNC_S = 5.0  # a sync turn's latency until the first (the probe) has answered
SAFETY_S = 2.0  # kept free before the deadline
MIN_SAMPLES = 3  # batch latencies observed before their p90 hedges
CACHE_S = 0.2  # a latency quantile is reused this long (every waiting turn asks for it)
SIMILAR = 0.5  # a batch's p90 hedge counts batches at least this share of its size
TAIL_SHARE = 0.1
ROUTE_Q = 0.9  # the batch latency quantile a turn routed to the batch API must fit
RATE_TAU_S = 10.0  # the sync throughput forgets what it saw this many busy seconds ago
PRIOR_TURNS = 2.0  # the throughput's prior: this many turns answered one at a time


@dataclass
class SyncThroughput:
    """How fast the sync path answers turns when many are sent: answered turns per second of
    busy time (some turn routed to it unanswered), both decayed over ``RATE_TAU_S``.

    Before much is seen, ``PRIOR_TURNS`` pseudo-turns answered one at a time at the single
    request latency dominate: conservative (a sync path's concurrency is at least one), so a
    backlog is never assumed to drain faster than it has been seen to. Idle time forgets
    nothing (the batch rounds between bursts of sync turns would reset it to the prior)."""

    backlog: int = 0  # turns routed to or racing on the sync path, not yet answered
    done: float = 0.0
    busy_s: float = 0.0
    at: float = field(default_factory=time.monotonic)

    def _advance(self, now: float) -> None:
        dt = max(now - self.at, 0.0)
        if self.backlog > 0:  # forgets over busy time: a quiet spell keeps what was learned
            decay = math.exp(-dt / RATE_TAU_S)
            self.done *= decay
            self.busy_s = self.busy_s * decay + dt
        self.at = now

    def joined(self) -> None:
        self._advance(time.monotonic())
        self.backlog += 1

    def left(self, answered: bool) -> None:
        self._advance(time.monotonic())
        self.backlog = max(self.backlog - 1, 0)
        if answered:
            self.done += 1.0

    def rate(self, latency: float) -> float:
        """Turns per second, ``latency`` being one request's (the prior's pace)."""
        self._advance(time.monotonic())
        return (self.done + PRIOR_TURNS) / (self.busy_s + PRIOR_TURNS * max(latency, 1e-3))


@dataclass
class Latencies:
    """Observed seconds, each with the number of turns it was measured over (a provider batch
    ends with its slowest request, so a big one takes longer than a small one).

    Quantiles count the batches still open (``running``: their ages, with their sizes) as
    censored, Kaplan-Meier style: the batches that end first are the fast ones, so the
    quantile of the ended ones alone is too low (with 125 batches out at once, the p90 of the
    first three to end hedged every other one). A quantile the ended batches cannot reach yet
    is None, or with ``bound`` the oldest age seen: a lower bound."""

    samples: list[float] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)

    def add(self, seconds: float, size: int = 1) -> None:
        self.samples.append(seconds)
        self.sizes.append(size)
        if len(self.samples) > 2000:
            del self.samples[:1000]
            del self.sizes[:1000]

    def of_size(self, at_least: float) -> list[float]:
        """The samples measured over at least ``at_least`` turns."""
        return [s for s, n in zip(self.samples, self.sizes, strict=True) if n >= at_least]

    def quantile(self, q: float, at_least: float = 0,
                 running: Iterable[tuple[float, int]] = (), *,
                 bound: bool = False) -> float | None:
        ended = self.of_size(at_least)
        ages = [age for age, n in running if n >= at_least]
        if not ended and not ages:
            return None
        events = sorted([(t, True) for t in ended] + [(t, False) for t in ages])
        at_risk, surviving = len(events), 1.0
        for t, done in events:  # ties: an end before a censoring at the same age
            if done:
                surviving *= 1.0 - 1.0 / at_risk
                if surviving <= 1.0 - q + 1e-12:
                    return t
            at_risk -= 1
        return events[-1][0] if bound else None


@dataclass
class _Open:
    """A provider batch still being watched."""

    id: str
    submitted: float
    wanted: set[str]
    size: int = 0  # turns it was submitted with


_KINDS: dict[str, type[BackendError]] = {
    "server_error": ServerError, "rate_limited": RateLimited, "bad_request": BadRequest,
    "expired": BackendTimeout, "cancelled": ServerError, "missing": ServerError}


class ProviderBatchTurns:
    """The provider-batch side of one embedded batch."""

    def __init__(self, client: ProviderBatchClient, backend: Backend, *,
                 mode: Literal["batch", "auto"], deadline: float | None, total: int) -> None:
        self.client = client
        self.backend = backend
        self.mode = mode
        self.deadline = deadline  # time.monotonic()
        self.total = total
        self.batch_latency = Latencies()
        self.sync_latency = Latencies()
        self.sync_path = SyncThroughput()
        self._routed_sync = 0  # routed to the sync API, its request not yet started
        self.stats: Counter[str] = Counter()
        self._pending: list[tuple[str, ModelRequest]] = []
        self._futures: dict[str, asyncio.Future[ItemResult]] = {}
        self._owner: dict[str, _Open] = {}
        self._open: dict[str, _Open] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._flusher: asyncio.Task[None] | None = None
        self._ids = itertools.count()
        self._probed = False  # "auto": the first routed turn measures the sync latency
        self._http = asyncio.Semaphore(HTTP_AT_ONCE)  # many small batches: bounded calls
        self._quantiles: dict[tuple[float, float, bool], tuple[float, float | None]] = {}

    # --- routing ---------------------------------------------------------------------------

    def batch_estimate(self, q: float = 0.9) -> float | None:
        """Seconds a provider batch takes (window included): the ``q`` quantile of the ended
        ones, the open ones censored at their age; before it is known, the oldest age seen
        (a lower bound)."""
        seen = self._quantile(q, 0, bound=True)
        return None if seen is None else seen + WINDOW_S

    def _quantile(self, q: float, at_least: float, *, bound: bool = False) -> float | None:
        """``batch_latency``'s quantile with the open batches censored, reused for
        ``CACHE_S`` (each waiting turn asks about once a second)."""
        now = time.monotonic()
        key = (q, at_least, bound)
        hit = self._quantiles.get(key)
        if hit is not None and now - hit[0] < CACHE_S:
            return hit[1]
        running = [(now - o.submitted, o.size) for o in self._open.values()]
        value = self.batch_latency.quantile(q, at_least, running, bound=bound)
        self._quantiles[key] = (now, value)
        return value

    def sync_estimate(self, ahead: int | None = None) -> float:
        """Seconds per sync turn with ``ahead`` turns before it on the sync path (default:
        its backlog): one request's p90 latency, or the backlog over the observed
        throughput when that is longer (queued turns finish late)."""
        seen = self.sync_latency.quantile(0.9)
        latency = PRIOR_SYNC_S if seen is None else seen
        if ahead is None:
            ahead = self.sync_path.backlog
        median = self.sync_latency.quantile(0.5)
        rate = self.sync_path.rate(PRIOR_SYNC_S if median is None else median)
        return max(latency, (ahead + 1) / rate)

    def _to_sync(self, why: str) -> Route:
        self.stats[why] += 1
        self._routed_sync += 1
        self.sync_path.joined()  # in the backlog from now: it queues for a slot
        return "sync"

    def route(self, turns_left: float, live: int) -> Route:
        """Where the next turn of an agent with ``turns_left`` (estimated) turns goes."""
        if self.mode == "batch" or self.deadline is None:
            return "batch"
        if not self._probed and not self.sync_latency.samples:
            self._probed = True  # one turn at list price buys the sync latency for routing
            return self._to_sync("routed_sync_probe")
        if turns_left <= 1 and live <= max(1, TAIL_SHARE * self.total):
            return self._to_sync("routed_sync_tail")
        batch = self.batch_estimate(ROUTE_Q) or 0.0
        per_sync = self.sync_estimate()  # behind the sync path's backlog
        finish = time.monotonic() + batch + (turns_left - 1) * per_sync + SAFETY_S
        if finish > self.deadline and (batch == 0.0 or per_sync < batch):
            return self._to_sync("routed_sync_deadline")
        if finish > self.deadline:
            self.stats["kept_batch_sync_backed_up"] += 1
        return "batch"

    def _hedge_at(self, submitted: float, turns_left: float,
                  size: int | None) -> float | None:
        """When a waiting batch turn should race the sync API (None: not yet known).

        With a deadline: when its remaining turns would only just fit on the sync API.
        Without one: past the p90 of provider batches at least ``SIMILAR`` times the size of
        the turn's own (``size``; None while it is not submitted): a batch ends with its
        slowest request, so the p90 of small batches would hedge a big one still on course,
        every turn of it at the sync price."""
        times = []
        if size is not None and self.deadline is None:
            similar = self.batch_latency.of_size(SIMILAR * size)
            p90 = self._quantile(0.9, SIMILAR * size)
            if p90 is not None and len(similar) >= MIN_SAMPLES:
                times.append(submitted + p90)
        if self.deadline is not None:  # the batch turns waiting would hedge with it
            waiting = max(len(self._futures) - 1, 0)
            ahead = self.sync_path.backlog + waiting
            times.append(self.deadline - self.sync_estimate(ahead)
                         - (turns_left - 1) * self.sync_estimate() - SAFETY_S)
        return min(times, default=None)

    # --- the two paths ---------------------------------------------------------------------

    async def sync(self, request: ModelRequest) -> ModelResponse:
        """One turn routed to the sync API (``route``), its latency observed."""
        if self._routed_sync > 0:  # it joined the backlog when routed
            self._routed_sync -= 1
            return await self._sync(request, joined=True)
        return await self._sync(request)

    async def _sync(self, request: ModelRequest, *, joined: bool = False) -> ModelResponse:
        """One request to the sync API; its latency and the sync path's throughput observed."""
        if not joined:
            self.sync_path.joined()
        answered = False
        started = time.monotonic()
        try:
            response = await self.backend.complete(request)
            answered = True
        finally:
            self.sync_path.left(answered)
        self.sync_latency.add(time.monotonic() - started)
        return response

    async def complete(self, request: ModelRequest, turns_left: float) -> tuple[ModelResponse,
                                                                                  bool]:
        """The reply to ``request`` and whether the provider batch served it (else sync)."""
        cid = f"t{next(self._ids)}-{request.request_id or 'turn'}"[:64]
        future: asyncio.Future[ItemResult] = asyncio.get_running_loop().create_future()
        self._futures[cid] = future
        self._pending.append((cid, request))
        self.stats["batch_sent"] += 1
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        submitted = time.monotonic()
        try:
            while not future.done():
                opened = self._owner.get(cid)  # p90s run from a batch's submit, not the window
                at = self._hedge_at(submitted if opened is None else opened.submitted,
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
                return await self._settle(cid, request, future.result())
            self._forget(cid)  # the batch's answer, if it comes, is dropped
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
        allowed = self.deadline is None or time.monotonic() < self.deadline - SAFETY_S
        if error.retryable and allowed:
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
        while self._pending:
            chunk, self._pending = self._pending[:MAX_ITEMS], self._pending[MAX_ITEMS:]
            chunk = [(cid, req) for cid, req in chunk if cid in self._futures]
            if chunk:  # submitted side by side: a round of many small batches goes out at once
                self._spawn(self._submit(chunk))

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
                    return
                now = time.monotonic()
                delay = min(max(POLL_SHARE * (now - opened.submitted), WATCH_MIN_S), WATCH_MAX_S)
                await asyncio.sleep(min(delay, max(give_up - now, 0.01)))
            try:
                async with self._http:
                    found = await self.client.results(opened.id, sorted(opened.wanted))
            except Exception as exc:
                found = {cid: ItemResult(cid, error=ItemError(
                    "server_error", f"provider batch {opened.id} ({state.status}): {exc}"))
                    for cid in opened.wanted}
            if any(item.ok for item in found.values()):
                self.batch_latency.add(time.monotonic() - opened.submitted, opened.size)
            failed = sum(not item.ok for item in found.values())
            if failed:
                log.warning("provider batch %s ended %s with %d of %d turns unanswered",
                            opened.id, state.status, failed, len(found))
            self._resolve(found)
        finally:
            self._open.pop(opened.id, None)

    async def _cancel(self, opened: _Open, why: str) -> None:
        self.stats["provider_batches_cancelled"] += 1
        log.info("cancelling provider batch %s: %s", opened.id, why)
        try:
            await asyncio.wait_for(self.client.cancel(opened.id), timeout=60)
        except Exception as exc:
            log.warning("provider batch %s could not be cancelled: %s", opened.id, exc)

    def _resolve(self, items: dict[str, ItemResult]) -> None:
        for cid, item in items.items():
            future = self._futures.get(cid)
            if future is not None and not future.done():
                future.set_result(item)

    def _forget(self, cid: str) -> None:
        self._futures.pop(cid, None)
        opened = self._owner.pop(cid, None)
        if opened is not None:
            opened.wanted.discard(cid)

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
        self._open.clear()
        await self.client.aclose()
