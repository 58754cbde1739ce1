"""Where a turn goes under ``pricing="batch"`` / ``"auto"``, and when a waiting batch turn
races the sync API: the estimates and decisions both engines share (``Router``).

The embedded engine (``batch_turns.py``) keeps one router per batch; the distributed engine
(``distributed/provider_batches.py``) one per batch per worker process, so each worker routes
on the latencies it observed itself (like ``hedge_after``'s per-worker p95s), with the agent's
turns and the batch's live count read from the state and meta it already has.

``route``: a turn goes to the batch API while the agent's projected finish -- this turn at
the ``route_q`` batch latency, its remaining turns at the sync latency -- stays inside the
deadline, or while the sync API would not finish the turn sooner (a sync path backed up past
a batch round gains the deadline nothing); else to the sync API. ``route_q`` is the break-
even chance of the batch answering in time: a batch turn not answered by its hedge time
races the sync API, and then pays the sync price as well as the batch's (whose item is
billed when the batch completes: 366 of 400 hedges in a bench_cost all-batch run). At a
batch price ``b`` of the sync price, the batch route costs ``b + (1 - p)`` for a turn
answered in time with chance ``p``, the sync route 1: the batch pays while ``p > b``. So
``route_q`` is ``b`` from the batch's price table (``pricing.batch_price_ratio``),
``ROUTE_Q`` (the batch APIs' half price, OpenAI's and Anthropic's) without one. Routing at
the p90 instead (before) sent the last turn of almost every agent to the sync API when the
deadline was short: bench_cost at 0.8x the all-batch wall, 871 of 1,000 agents' last turns,
where the clairvoyant bound needed 384; their third turn started ~18 s in, the p90 batch
turn (13.3 s) and ``SAFETY_S`` fitting only before ~14.6 s, while the median batch turn (9.0
s) would have fitted. The quantiles count the provider batches still open as censored at
their age (``Latencies``): the first to end are the fast ones. The sync latency is measured,
not assumed: the first turn ``"auto"`` routes goes to the sync API (a probe;
``PRIOR_SYNC_S`` stands in until it answers). At the batch's tail (at most ``TAIL_SHARE`` of
its agents still running) an agent's last estimated turn goes to the sync API: nobody waits
a batch round for it.

A sync turn is not one request's latency when many are sent at once: they queue (inference
slots, the client's in-flight cap, the server). So a sync turn is estimated from the sync
path's backlog -- turns routed to it not yet answered, plus, for a hedge, the batch turns
likely to be still waiting then, which would hedge with it (``late_turns``) -- divided
by its throughput (``SyncThroughput``): what was seen, and no less than the sync path's
concurrency per request latency where the engine knows it (the embedded engine's in-flight
cap; the distributed engine's worker does not know its share of the fleet's, and uses what
it saw).
bench_cost.py at 1.1x the all-batch wall, at load 28: turns routed and hedged at the
one-request estimate (~50 ms) left 827 of 1,000 agents past a deadline the all-batch run met.

Sizes (``pick_size``): a provider batch ends with its slowest request, so where the provider
finishes small batches sooner (the simulator: the maximum of its requests' log-normal
latencies), a turn the deadline presses can go in a small batch at the batch price instead of
to the sync API at twice that. Each size's latency is learnt apart (batches of ``size // 2 +
1`` to ``size`` turns): the first turns routed to the batch API with room go in small batches
to learn them (``_explore``: ``MIN_SIZE_SAMPLES`` per size; a window's turns fill full
batches, so small ones were almost never seen otherwise). A turn then goes in the largest size
that answers by ``FIT_Q`` in time, and only where none answers even at ``route_q`` does it go
to the sync API. Where small batches are not faster, nothing changes but a few learning
batches. bench_cost, 1,000 agents at 0.8x the all-batch wall, one run: 0.528 of all-sync's
cost against 0.62 with full batches only (54 turns routed to the sync API for the deadline
against 454; 1,124 provider batches against 319).

``hedge_at``: with a deadline, a waiting turn races the sync API when its remaining turns
would only just fit before the deadline on the sync API (earlier would pay the sync price for
nothing the deadline needs). Without one, past the observed p90 latency of provider batches
of a similar size (a batch ends with its slowest request).

The hedge cap: with a deadline, many turns reach their hedge time together (they share the
estimate), and a sync path that answers ``rate`` turns a second can only finish ``rate x (time
left)`` of them before the deadline. Sending them all (bench_cost on a CPU-starved machine)
slowed every sync turn, the routed ones too, and missed deadlines. So a due hedge goes only
while the sync path's work -- its backlog plus the hedges decided whose request has not
started (``GRANT_S`` at most) -- is under that (at least one); the turns beyond it keep
waiting in their provider batch (``hedge_capped``, once per turn) and ask again. The time
left is the deadline's itself: the margin is kept by the hedge time already, and counting
it again left the turns due a few ms past their hedge time a cap near one, so they waited on
batches that answered past the deadline (bench_cost at 0.8x, routing at the median: 122
turns capped ~2 s before the deadline, 55 agents 0.06-0.11 s late; hedges there took 0.1-0.2
s).

The margin kept free before the deadline (``safety``) is ``SAFETY_MULT`` times the sync
path's observed p99 latency, at least ``SAFETY_MIN_S`` (a waiting turn re-reads its hedge
time at least once a second), and ``SAFETY_S`` until a sync latency is seen. A constant 2 s
meant nothing to a deadline hours away with 30 s sync turns, and sent turns that fitted to
the sync API in bench_cost, whose scaled sync turns take 0.07-0.2 s. Measured, it grows with
what slows the sync path (a loaded machine, a slow model) and shrinks where turns are quick.

Times: ``clock`` is the router's (the embedded engine's ``time.monotonic``, the distributed
engine's Redis clock, in which the plan carries the deadline); every absolute time given to
or returned by a router is in it. Durations (latencies) are measured with ``time.monotonic``.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

from agentbatch.backends.provider_batch.client import DEFAULT_MAX_ITEMS
from agentbatch.core.pricing import batch_price_ratio

Route = Literal["sync", "batch"]
WINDOW_S = 0.25  # turns ready this close together share one provider batch
PRIOR_SYNC_S = 5.0  # a sync turn's latency until the first (the probe) has answered
SAFETY_S = 2.0  # kept free before the deadline until a sync latency is seen (``safety``)
SAFETY_MIN_S = 1.0  # the measured margin's floor: a waiting turn re-reads its hedge time
SAFETY_MULT = 4.0  # ... at least every 1 s, at ``at`` itself when the time does not move;
# 0.5 s left 17 of 1,000 agents 0.02 s late in one of two bench_cost runs at 0.8x (the end's
# burst of hedges and commits on a 2-core machine is slower than one sync request's p99)
MIN_SAMPLES = 3  # batch latencies observed before their p90 hedges
CACHE_S = 0.2  # a latency quantile is reused this long (every waiting turn asks for it)
SIMILAR = 0.5  # a batch's p90 hedge counts batches at least this share of its size
TAIL_SHARE = 0.1
FIT_Q = 0.9  # ``pick_size``: a turn goes in the largest batch size it fits at this quantile
MIN_SIZE_SAMPLES = 5  # ended batches of about a size before that size's latency is used
ROUTE_Q = 0.5  # the batch latency quantile a routed batch turn must fit: the batch price
# over the sync price, the break-even chance to be answered before a hedge (module doc);
# this one where the batch has no price table
ROUTE_Q_RANGE = (0.05, 0.99)  # a price ratio is clamped to this: batch routing stays possible
RATE_TAU_S = 10.0  # the sync throughput forgets what it saw this many busy seconds ago
PRIOR_TURNS = 2.0  # the throughput's prior: this many turns answered one at a time
GRANT_S = 10.0  # a hedge decided counts against the cap this long before its request starts


def route_q_for(prices: Mapping[str, Mapping[str, float]] | None) -> float:
    """The routing quantile for a batch with ``prices`` (the plan's: the batch model's entry
    only): its batch price over its sync price, ``ROUTE_Q`` without a table."""
    entry = next(iter(prices.values()), None) if prices else None
    return batch_price_ratio(entry, ROUTE_Q)


@dataclass
class SyncThroughput:
    """How fast the sync path answers turns when many are sent: answered turns per second of
    busy time (some turn routed to it unanswered), both decayed over ``RATE_TAU_S``.

    Before much is seen, ``PRIOR_TURNS`` pseudo-turns answered one at a time at the single
    request latency dominate: conservative (a sync path's concurrency is at least one), so a
    backlog is never assumed to drain faster than it has been seen to. Idle time forgets
    nothing (the batch rounds between bursts of sync turns would reset it to the prior)."""

    backlog: int = 0  # turns routed to or racing on the sync path, not yet answered
    # requests the sync path runs at once, where known (the embedded engine's in-flight cap):
    # the rate is then at least ``concurrency`` per request latency (``rate``). 1: unknown
    concurrency: int = 1
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
        latency = max(latency, 1e-3)
        seen = (self.done + PRIOR_TURNS) / (self.busy_s + PRIOR_TURNS * latency)
        if self.concurrency > 1:  # Little's law: at most ``concurrency`` in flight at once
            return max(seen, self.concurrency / latency)
        return seen


@dataclass(frozen=True)
class Survival:
    """Kaplan-Meier steps: ``surviving[i]`` is the share of batches still open just after
    ``times[i]`` (the ended latencies, ascending, a tied end repeated); ``last`` is the
    latest time seen, ended or open (None: nothing seen)."""

    times: list[float]
    surviving: list[float]
    last: float | None

    def at(self, t: float) -> float:
        """The share of batches still open ``t`` seconds after submission."""
        i = bisect.bisect_right(self.times, t) - 1
        return 1.0 if i < 0 else self.surviving[i]


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
    version: int = 0  # one more per ``add``: what ``count`` caches on
    _counts: dict[tuple[float, float], tuple[int, int]] = field(default_factory=dict,
                                                                repr=False)

    def add(self, seconds: float, size: int = 1) -> None:
        self.samples.append(seconds)
        self.sizes.append(size)
        self.version += 1
        if len(self.samples) > 2000:
            del self.samples[:1000]
            del self.sizes[:1000]

    def count(self, at_least: float, at_most: float = math.inf) -> int:
        """``len(of_size(at_least, at_most))``, kept until the next ``add``: routing asks it
        for every size on every turn (a scan of up to 2,000 samples each time made
        ``Router.decide`` 15x slower)."""
        hit = self._counts.get((at_least, at_most))
        if hit is not None and hit[0] == self.version:
            return hit[1]
        found = len(self.of_size(at_least, at_most))
        self._counts[(at_least, at_most)] = (self.version, found)
        return found

    def of_size(self, at_least: float, at_most: float = math.inf) -> list[float]:
        """The samples measured over ``at_least`` to ``at_most`` turns."""
        return [s for s, n in zip(self.samples, self.sizes, strict=True)
                if at_least <= n <= at_most]

    def survival(self, running: Iterable[tuple[float, int]] = (),
                 at_least: float | None = None, at_most: float = math.inf) -> Survival:
        """The Kaplan-Meier survival of the samples (measured over ``at_least`` to
        ``at_most`` turns; ``at_least`` None: all), the open batches ``running`` (age, turns)
        censored at their age: what ``quantile`` and ``Router.late_turns`` both read, built
        in one place."""
        if at_least is None:
            ended, ages = self.samples, [age for age, _ in running]
        else:
            ended = self.of_size(at_least, at_most)
            ages = [age for age, n in running if at_least <= n <= at_most]
        events = sorted([(t, True) for t in ended] + [(t, False) for t in ages])
        times: list[float] = []
        surviving: list[float] = []
        at_risk, left = len(events), 1.0
        # ties: (t, False) sorts first, so a batch open at an ended one's age is censored
        # before that end is counted (it is not at risk there)
        for t, done in events:
            if done:
                left *= 1.0 - 1.0 / at_risk
                times.append(t)
                surviving.append(left)
            at_risk -= 1
        return Survival(times, surviving, events[-1][0] if events else None)

    def quantile(self, q: float, at_least: float = 0,
                 running: Iterable[tuple[float, int]] = (), *,
                 bound: bool = False, at_most: float = math.inf) -> float | None:
        curve = self.survival(running, at_least, at_most)
        for t, left in zip(curve.times, curve.surviving, strict=True):
            if left <= 1.0 - q + 1e-12:
                return t
        return curve.last if bound else None


def _no_open() -> Iterable[tuple[float, int]]:
    return ()


class Router:
    """The routing and hedging state of one batch (on one process): the latencies observed,
    the sync path's backlog, and what was decided (``stats``)."""

    def __init__(self, mode: Literal["batch", "auto"], deadline: float | None, total: int, *,
                 clock: Callable[[], float] = time.monotonic,
                 running: Callable[[], Iterable[tuple[float, int]]] = _no_open,
                 concurrency: int = 1, route_q: float = ROUTE_Q) -> None:
        self.mode = mode
        # the batch latency quantile a routed batch turn must fit (module doc)
        self.route_q = min(max(route_q, ROUTE_Q_RANGE[0]), ROUTE_Q_RANGE[1])
        self.deadline = deadline  # in ``clock``'s time
        self.total = total
        self.clock = clock
        self.running = running  # the provider batches still open: (age s, turns)
        self.batch_latency = Latencies()
        self.sync_latency = Latencies()
        # ``concurrency``: the sync requests that can run at once, where the caller knows it
        # (1: not known). Known, the sync path is estimated at no less than that many per
        # request latency. Not known, the throughput is only what was seen: a single probe
        # looks like one turn at a time, so every waiting turn looked due for a hedge early
        # (393 to 984 turns of 1,000 agents hedged at 2x the all-batch wall in five
        # bench_cost runs, each paid at the sync price for a deadline all-batch met).
        self.sync_path = SyncThroughput(concurrency=max(1, concurrency))
        self.routed_sync = 0  # routed to the sync API (in its backlog), request not started
        self.stats: Counter[str] = Counter()
        self._probed = False  # "auto": the first routed turn measures the sync latency
        self._probing = False  # ... and it has not ended yet
        self._quantiles: dict[tuple[float, float, bool, float],
                              tuple[float, float | None]] = {}
        # the provider batch sizes a turn may be sent in (``pick_size``): the batch client's
        # ``max_items`` and ``min_items``, set by the engine once it has the client
        self.max_items = DEFAULT_MAX_ITEMS
        self.min_items = 1
        self._explored: Counter[int] = Counter()  # turns sent to learn a size (``_explore``)
        self._granted: deque[float] = deque()  # hedges decided, request not started (when)
        self._capped: set[Hashable] = set()  # the turns a due hedge was refused (counted)
        # late_turns' inputs, kept CACHE_S: (when, open batches, their survival, counts)
        self._late: tuple[float, list[tuple[float, int]], Survival,
                          dict[float, int]] | None = None

    def quantile(self, q: float, at_least: float = 0, *, bound: bool = False,
                 at_most: float = math.inf) -> float | None:
        """``batch_latency``'s quantile (of batches of ``at_least`` to ``at_most`` turns) with
        the open batches censored, reused for ``CACHE_S`` (each waiting turn asks about once
        a second)."""
        now = time.monotonic()
        key = (q, at_least, bound, at_most)
        hit = self._quantiles.get(key)
        if hit is not None and now - hit[0] < CACHE_S:
            return hit[1]
        value = self.batch_latency.quantile(q, at_least, self.running(), bound=bound,
                                            at_most=at_most)
        self._quantiles[key] = (now, value)
        return value

    def batch_estimate(self, q: float = 0.9) -> float | None:
        """Seconds a provider batch takes (window included): the ``q`` quantile of the ended
        ones, the open ones censored at their age; before it is known, the oldest age seen
        (a lower bound)."""
        seen = self.quantile(q, 0, bound=True)
        return None if seen is None else seen + WINDOW_S

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

    def safety(self) -> float:
        """Seconds kept free before the deadline: ``SAFETY_MULT`` times the sync path's
        observed p99 latency, at least ``SAFETY_MIN_S``; ``SAFETY_S`` until one is seen. In
        units of what was measured, not a constant: 2 s is nothing to a deadline hours away
        whose sync turns take 30 s, and 7% of bench_cost's scaled 28 s deadline, whose sync
        turns take 0.07-0.2 s (there it sent turns that fitted to the sync API)."""
        p99 = self.sync_latency.quantile(0.99)
        if p99 is None:
            return SAFETY_S
        return max(SAFETY_MIN_S, SAFETY_MULT * p99)

    def _to_sync(self, why: str) -> tuple[Route, str]:
        self.stats[why] += 1
        self.routed_sync += 1
        self.sync_path.joined()  # in the backlog from now: it queues for a slot
        return "sync", why

    def sizes(self) -> list[int]:
        """The provider batch sizes a turn may go in, largest first: ``max_items`` halved
        down to ``min_items``."""
        size, least = max(self.max_items, 1), max(self.min_items, 1)
        found = [size]
        while size // 2 >= least:
            size //= 2
            found.append(size)
        return found

    def size_estimate(self, q: float, size: int) -> float | None:
        """Seconds (window included) a provider batch of about ``size`` turns takes (those
        of ``size // 2 + 1`` to ``size`` turns), at quantile ``q``; None with fewer than
        ``MIN_SIZE_SAMPLES`` ended. The largest size falls back to every batch seen
        (``batch_estimate``), as before sizes were told apart."""
        least = size // 2 + 1
        if self.batch_latency.count(least, size) >= MIN_SIZE_SAMPLES:
            seen = self.quantile(q, least, at_most=size)
            if seen is not None:
                return seen + WINDOW_S
        return self.batch_estimate(q) if size >= self.max_items else None

    def _rest(self, turns_left: float) -> tuple[float, float]:
        """Seconds per sync turn (behind the sync path's backlog), and what an agent with
        ``turns_left`` turns needs after this one: its other turns on the sync API and the
        margin (``decide``, ``pick_size`` and ``hedge_at`` read both)."""
        per_sync = self.sync_estimate()
        return per_sync, (turns_left - 1) * per_sync + self.safety()

    def pick_size(self, turns_left: float, rest: float | None = None) -> tuple[int, float]:
        """The provider batch size for an agent's next turn, and that size's ``route_q``
        latency (0.0: none seen yet). A batch ends with its slowest request, so where a
        provider finishes small batches sooner (the simulator: the maximum of its requests'
        latencies), a turn the deadline presses goes in a small one rather than to the
        sync API at twice the price. With a deadline: the largest size whose ``FIT_Q``
        latency leaves the agent's remaining turns room on the sync API (a turn answered
        in time, not hedged); if none does, the size that answers soonest at ``route_q``
        (``decide`` then weighs it against the sync API). Without a deadline, or where
        small batches are not seen to be faster, ``max_items``: fewer batches to poll.
        ``rest``: ``_rest``'s, where the caller has it already."""
        sizes = self.sizes()
        full = sizes[0]
        if self.deadline is None or self.mode == "batch":
            return full, self.batch_estimate(self.route_q) or 0.0
        if rest is None:
            rest = self._rest(turns_left)[1]
        room = self.deadline - self.clock() - rest
        fastest: tuple[float, int] | None = None
        for size in sizes:
            at_q = self.size_estimate(self.route_q, size)
            if at_q is None:
                continue
            sure = self.size_estimate(FIT_Q, size)
            if sure is not None and sure <= room:
                return size, at_q
            if fastest is None or at_q < fastest[0]:
                fastest = (at_q, size)
        if fastest is None:
            return full, 0.0
        return fastest[1], fastest[0]

    def _explore(self) -> int | None:
        """A provider batch size smaller than ``max_items`` whose latency is not known yet
        (fewer than ``MIN_SIZE_SAMPLES`` ended), smallest first, with fewer than
        ``MIN_SIZE_SAMPLES`` turns sent to learn it; None when every size is known or being
        learned. Full batches rarely leave small ones behind (a window's turns fill them),
        so without this the router never sees a small batch's latency."""
        for size in reversed(self.sizes()[1:]):
            if (self._explored[size] < MIN_SIZE_SAMPLES
                    and self.batch_latency.count(size // 2 + 1, size) < MIN_SIZE_SAMPLES):
                return size
        return None

    def decide(self, turns_left: float, live: int) -> tuple[Route, str, int]:
        """``route``, with why (the stat it counted: ``routed_sync_probe``,
        ``routed_sync_tail``, ``routed_sync_deadline``, ``routed_batch``) and, for the batch
        API, the provider batch size the turn may go in (``pick_size``; smaller than
        ``max_items``: also counted ``routed_batch_small``). While a size's latency is not
        known, the first turns routed to the batch API with room to spare go in batches of
        that size (``_explore``, ``routed_batch_explore``): learning costs them nothing, as
        they are answered in time whatever the size. A pressed turn is not sent to learn
        one: it would pay the sync price as well when late. Learnt only by pressed turns
        (tried first), the sizes came too late to size anything (bench_cost at 0.8x)."""
        full = self.sizes()[0]
        if self.mode == "batch" or self.deadline is None:
            return "batch", "", full
        if not self._probed and not self.sync_latency.samples:
            self._probed = self._probing = True  # one turn at list price buys the sync
            return (*self._to_sync("routed_sync_probe"), full)  # latency for routing
        if turns_left <= 1 and live <= max(1, TAIL_SHARE * self.total):
            return (*self._to_sync("routed_sync_tail"), full)
        per_sync, rest = self._rest(turns_left)
        size, batch = self.pick_size(turns_left, rest)
        finish = self.clock() + batch + rest
        if finish > self.deadline and (batch == 0.0 or per_sync < batch):
            return (*self._to_sync("routed_sync_deadline"), full)
        explore = self._explore() if finish <= self.deadline else None
        if explore is not None:  # a turn with room: learning a size costs it nothing
            self._explored[explore] += 1
            self.stats["routed_batch_explore"] += 1
            size = explore
        elif finish > self.deadline:
            self.stats["kept_batch_sync_backed_up"] += 1
        if size < full:
            self.stats["routed_batch_small"] += 1
        self.stats["routed_batch"] += 1
        return "batch", "routed_batch", size

    def route(self, turns_left: float, live: int) -> Route:
        """Where the next turn of an agent with ``turns_left`` (estimated) turns goes, the
        batch having ``live`` agents still running. A turn routed to the sync API is in the
        sync path's backlog until ``timed_sync(joined=True)`` (or ``unroute``) takes it."""
        return self.decide(turns_left, live)[0]

    def unroute(self) -> None:
        """A turn routed to the sync API that will not send its request (refused, failed)."""
        if self.routed_sync > 0:
            self.routed_sync -= 1
            self.sync_path.left(False)
        if self._probing and not self.sync_latency.samples:
            self._probed = False  # an unsent probe measured nothing: the next turn probes
        self._probing = False

    def hedge_cap(self) -> int:
        """How many turns the sync path may have outstanding (backlog and decided hedges)
        for another hedge to go: its observed throughput times the time left before the
        deadline (the margin is kept by the hedge time, not here), at least one."""
        assert self.deadline is not None
        left = self.deadline - self.clock()
        median = self.sync_latency.quantile(0.5)
        rate = self.sync_path.rate(PRIOR_SYNC_S if median is None else median)
        return max(1, math.floor(rate * left))

    def outstanding(self) -> int:
        """The sync path's backlog plus the hedges decided whose request has not started."""
        now = time.monotonic()
        while self._granted and now - self._granted[0] > GRANT_S:
            self._granted.popleft()  # never started (the batch answered first): forgotten
        return self.sync_path.backlog + len(self._granted)

    def _may_hedge(self, turn: Hashable) -> bool:
        """A due hedge goes (and is counted against the cap until its request starts), or
        is refused at the cap: the turn keeps waiting in its provider batch."""
        if self.outstanding() < self.hedge_cap():
            self._granted.append(time.monotonic())
            self._capped.discard(turn)
            return True
        if turn not in self._capped:
            if len(self._capped) > 10_000:
                self._capped.clear()
            self._capped.add(turn)
            self.stats["hedge_capped"] += 1
        return False

    def hedge_at(self, submitted: float, turns_left: float, size: int | None,
                 waiting: int = 0, *, turn: Hashable | None = None) -> float | None:
        """When a waiting batch turn should race the sync API (None: not yet known).

        With a deadline: when its remaining turns would only just fit on the sync API, behind
        the sync path's backlog and those of the ``waiting`` batch turns likely to be still
        waiting then (``late_turns``), which would hedge with it.
        Without one: past the p90 of provider batches at least ``SIMILAR`` times the size of
        the turn's own (``size``; None while it is not submitted): a batch ends with its
        slowest request, so the p90 of small batches would hedge a big one still on course,
        every turn of it at the sync price. While ``"auto"``'s probe is out, the deadline's
        hedge time is not known: on the prior (``PRIOR_SYNC_S`` a turn, behind every waiting
        turn) a worker claiming turns as the probe leaves hedged every one of them.

        With a deadline, a time that has come is a hedge decided: the caller sends it now.
        At the hedge cap (``hedge_cap``) it is None instead (the turn keeps waiting and asks
        again), counted once per ``turn`` (default: per ``(submitted, size)``)."""
        times = []
        if size is not None and self.deadline is None:
            similar = self.batch_latency.of_size(SIMILAR * size)
            p90 = self.quantile(0.9, SIMILAR * size)
            if p90 is not None and len(similar) >= MIN_SAMPLES:
                times.append(submitted + p90)
        if self.deadline is not None and not (self._probing and not self.sync_latency.samples):
            rest = self._rest(turns_left)[1]
            latest = self.deadline - self.sync_estimate() - rest  # nobody hedges with it
            joining = self.late_turns(max(latest - self.clock(), 0.0))
            ahead = self.sync_path.backlog + max(
                waiting if joining is None else min(waiting, joining), 0)
            at = self.deadline - self.sync_estimate(ahead) - rest
            if self.clock() >= at and not self._may_hedge(
                    (submitted, size) if turn is None else turn):
                return None
            times.append(at)
        return min(times, default=None)

    def late_turns(self, within: float) -> int | None:
        """The turns of the open provider batches expected to be still waiting ``within``
        seconds from now: the waiting turns a hedge then is likely to be joined by. Each
        open batch, ``a`` seconds old, counts its turns times the chance it is still open
        ``within`` later, ``S(a + within) / S(a)``, ``S`` the batch latencies' survival
        (Kaplan-Meier: the ended batches, the open ones censored at their age). Not every
        turn waiting now: most are answered before the deadline, and counting them all put
        every hedge early, both answers then paid (bench_cost, 300 agents at 1.1x the
        all-batch wall: 206 of 300 agents' turns hedged, 159 also billed by their batch).
        No latency seen yet: all of them; no open batch known (``running``): None."""
        now = time.monotonic()
        key = round(within * 2) / 2  # turns with the same hedge horizon share the count
        if self._late is None or now - self._late[0] >= CACHE_S:
            opened = list(self.running())
            self._late = (now, opened, self.batch_latency.survival(opened), {})
        _, opened, curve, counted = self._late
        if not opened:
            return None
        if not curve.times:
            return sum(n for _, n in opened)
        if key not in counted:
            expected = 0.0
            for age, n in opened:
                now_open = curve.at(age)
                expected += n * (curve.at(age + key) / now_open if now_open > 0 else 1.0)
            counted[key] = math.ceil(expected - 1e-9)
        return counted[key]

    def allows_sync(self) -> bool:
        """Whether a turn whose provider batch item failed may still go to the sync API."""
        return self.deadline is None or self.clock() < self.deadline - self.safety()

    @contextlib.contextmanager
    def timed_sync(self, *, routed: bool = False) -> Iterator[None]:
        """Around one request to the sync API: its latency and the sync path's throughput
        observed. ``routed``: a turn ``route`` sent here (already in the backlog)."""
        if routed and self.routed_sync > 0:
            self.routed_sync -= 1
        else:
            if self._granted:
                self._granted.popleft()  # a hedge decided: in the backlog from now
            self.sync_path.joined()
        answered = False
        started = time.monotonic()
        try:
            yield
            answered = True
        finally:
            self.sync_path.left(answered)
            self._probing = False
        self.sync_latency.add(time.monotonic() - started)
