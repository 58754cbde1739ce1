"""Several endpoints of one model as one ``Backend``: cache-aware routing with bounded load.

An agent's turns share an ever-growing prefix, so sending them to the same server keeps its
prefix cache hot. ``routing="affinity"`` (the default) gives each agent a home endpoint: the
one that served its last reply (``ModelResponse.endpoint``, kept in the agent's state and
sent back as ``ModelRequest.cached_on``), which holds its conversation. The state travels
with the agent, so on the distributed engine any worker sends an agent's turn to the same
server. A first turn has no home: it goes to the endpoint with the fewest in flight, ties by
the agent's rendezvous ranking over the endpoint names (``affinity.rank``), so a batch
starts balanced. A distributed worker's pool counts only its own process's turns in flight,
so it spreads first turns by the agent's number instead (``spread_first_turns``, set by
``setup.spread_first_turns``; ``affinity.spread``): every process places an agent alike, and
a batch splits evenly over the pool. A turn leaves its home only when the home is ejected or
suspect (it just failed) or holds more than its share of requests in flight
(``affinity.load_bound``: ``load_factor`` times the mean, at least ``load_floor``); it then
takes the agent's next choice in its ranking, and the move is counted (``moves()``: ``load``
/ ``failover``) and told to each listener (``add_move_listener``). A moved agent stays where
it moved: its conversation is there now. A move for load first carries that conversation
where the servers can (``_carry``: llama.cpp servers sharing a ``--slot-save-path`` save the
home's slot and restore it there), so the moved turn computes only what is new.
``routing="least_outstanding"`` sends every turn to the endpoint with the fewest in flight.

An endpoint that fails ``eject_after`` times in a row with a connection error or a timeout is
ejected: nothing is routed to it, and a background probe (``health()`` of the inner backend,
every ``probe_interval_s``) re-admits it once it answers again. One such failure short of that
makes it suspect for ``probe_interval_s``: it comes last in routing, so a retry goes elsewhere
at once, and a slow server stops receiving turns while it is slow.

The pool never retries by itself: the ``RetryingBackend`` around it does, and each retry is
routed afresh. With a ``hedger`` (``hedge_after=``, ``hedge.py``) a turn in flight past the
hedging bar is also sent to a second endpoint, and the first answer wins.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import Counter
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from agentbatch.backends.affinity import load_bound, rank, spread
from agentbatch.backends.base import Backend, BackendWrapper, ServerLoad
from agentbatch.backends.hedge import Attempt, Hedger
from agentbatch.core.errors import BackendError, BackendTimeout, BackendUnavailable, BatchSpecError
from agentbatch.core.model_io import Message, ModelRequest, ModelResponse
from agentbatch.core.options import DEFAULT_POOL_LOAD_FACTOR, PoolRouting
from agentbatch.core.wait_for import wait_for

log = logging.getLogger(__name__)

# Saving a moved agent's conversation on its home and restoring it where the turn goes
# (``EndpointPool._carry``): milliseconds for a small model; past this the turn goes without.
CARRY_TIMEOUT_S = 10.0

SleepFn = Callable[[float], Awaitable[None]]
MoveListener = Callable[[str], None]  # called with the reason of each move
ROUTINGS = get_args(PoolRouting)


def check_pool_options(routing: Any, load_factor: Any, backend: Any) -> None:
    """``pool_routing`` and ``pool_load_factor`` at submit: known values, and only where they
    can apply (a pool of >= 2 endpoints, hostfiles expanded; the load bound only with
    affinity). Raises ``BatchSpecError`` naming the option."""
    from agentbatch.backends.setup import expand_backend_urls

    if not isinstance(routing, str) or routing not in ROUTINGS:
        raise BatchSpecError(f"pool_routing must be one of {', '.join(map(repr, ROUTINGS))}, "
                             f"got {routing!r}")
    if (isinstance(load_factor, bool) or not isinstance(load_factor, int | float)
            or not math.isfinite(load_factor) or load_factor < 1):
        raise BatchSpecError(f"pool_load_factor must be a finite number >= 1 (a multiple of "
                             f"the pool's mean load), got {load_factor!r}")
    custom_bound = load_factor != DEFAULT_POOL_LOAD_FACTOR
    if routing == "affinity" and not custom_bound:
        return
    urls = expand_backend_urls([backend] if isinstance(backend, str) else list(backend or []))
    name = "pool_routing" if routing != "affinity" else "pool_load_factor"
    if len(urls) < 2:
        raise BatchSpecError(
            f"{name} cannot apply to backend {urls[0] if urls else backend!r}: it chooses "
            "among the endpoints of a pool, so it needs a list of >= 2 endpoints "
            "(backend=[url1, url2, ...])")
    if routing == "least_outstanding" and custom_bound:
        raise BatchSpecError(
            'pool_load_factor cannot apply with pool_routing="least_outstanding": the bound '
            "is when a turn leaves its agent's home endpoint, and least_outstanding routing "
            "has no home")


def parse_hostfile(path: str | Path, default_scheme: str = "http") -> list[str]:
    """Backend URLs from a file: one per line; ``#`` starts a comment; a bare ``host:port``
    becomes ``{default_scheme}://host:port``. ``BatchSpecError`` if unreadable or empty."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise BatchSpecError(f"cannot read hostfile {str(path)!r}: {exc.strerror}") from None
    urls = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            urls.append(line if "://" in line else f"{default_scheme}://{line}")
    if not urls:
        raise BatchSpecError(f"hostfile {str(path)!r} lists no endpoints")
    return urls


def pool_under(backend: Backend) -> EndpointPool | None:
    """The ``EndpointPool`` under ``backend``'s wrapping layers (retry, micro-batching);
    None for one endpoint."""
    while isinstance(backend, BackendWrapper):
        backend = backend.inner
    return backend if isinstance(backend, EndpointPool) else None


@dataclass
class _Endpoint:
    backend: Backend
    name: str
    outstanding: int = 0
    requests: int = 0
    errors: int = 0
    failures: int = 0  # consecutive connection failures / timeouts
    ejections: int = 0
    ejected: bool = False
    suspect_until: float = 0.0  # loop time; after a failure short of ejection
    probe: asyncio.Task[None] | None = None
    check: asyncio.Task[None] | None = None  # health check after a failure or a stall
    gone: asyncio.Future[str] | None = None  # resolved (with why) when it is ejected


class EndpointPool(Backend):
    """A ``Backend`` over several endpoints; see the module docstring."""

    def __init__(
        self,
        backends: list[Backend],
        *,
        eject_after: int = 3,
        probe_interval_s: float = 2.0,
        stall_check_s: float = 5.0,
        routing: str = "affinity",
        load_factor: float = DEFAULT_POOL_LOAD_FACTOR,
        load_floor: int = 2,
        sleep: SleepFn | None = None,
    ) -> None:
        if not backends:
            raise ValueError("EndpointPool needs at least one backend")
        if eject_after < 1:
            raise ValueError("eject_after must be >= 1")
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, not {routing!r}")
        if load_factor < 1 or load_floor < 1:
            raise ValueError("load_factor and load_floor must be >= 1")
        names: list[str] = []
        for b in backends:
            name = b.name
            while name in names:  # the same URL twice is legal; keep stats apart
                name += "'"
            names.append(name)
        self._eps = [_Endpoint(b, n) for b, n in zip(backends, names, strict=True)]
        self.name = "pool(" + ", ".join(names) + ")"
        self.capabilities = backends[0].capabilities
        self.eject_after = eject_after
        self.probe_interval_s = probe_interval_s
        self.stall_check_s = stall_check_s
        self.routing = routing
        self.load_factor = load_factor
        self.load_floor = load_floor
        self._sleep: SleepFn = sleep or asyncio.sleep
        self._names = names
        self._moves: Counter[str] = Counter()
        self._carries: Counter[str] = Counter()
        self._no_carry: set[tuple[str, str]] = set()  # (home, target) that share no files
        self._move_listeners: list[MoveListener] = []
        self._turn = 0
        self._closed = False
        # First turns by the agent's number, not by this process's turns in flight: set where
        # several processes share the pool's servers (a distributed worker).
        self.spread_first_turns = False
        self.hedger: Hedger | None = None  # set by ``hedge.enable_hedging``

    @property
    def backends(self) -> list[Backend]:
        return [ep.backend for ep in self._eps]

    def __repr__(self) -> str:
        return f"EndpointPool({self.name!r})"

    # -- routing ----------------------------------------------------------------------------

    def _suspect(self, ep: _Endpoint) -> bool:
        return ep.failures > 0 and ep.suspect_until > asyncio.get_running_loop().time()

    def _healthy_indices(self) -> list[int]:
        healthy = [i for i, ep in enumerate(self._eps) if not ep.ejected]
        if not healthy:
            raise BackendUnavailable(
                f"all {len(self._eps)} endpoints are ejected: "
                + ", ".join(ep.name for ep in self._eps)
            )
        return healthy

    def _bound(self, healthy: Collection[int]) -> int:
        """How many in flight an admitted endpoint may hold before a turn passes it by."""
        return load_bound(sum(self._eps[i].outstanding for i in healthy), len(healthy),
                          self.load_factor, self.load_floor)

    def _least_loaded(self) -> int:
        healthy = self._healthy_indices()
        n, start = len(self._eps), self._turn
        self._turn = (self._turn + 1) % n
        # An endpoint that just failed (not yet ejected) is the last choice, so a retry after a
        # refused connection goes elsewhere; then fewest in flight; ties rotate.
        return min(
            healthy,
            key=lambda i: (self._suspect(self._eps[i]), self._eps[i].outstanding, (i - start) % n),
        )

    def _placed(self, key: str) -> int:
        """Where an agent with nothing cached yet starts: spread by its number where several
        processes share the pool (``spread_first_turns``), else (or when every endpoint
        from its spread one on is out or past the load bound) the admitted endpoint with the
        fewest in flight, suspect ones last, ties by the agent's ranking. Its conversation
        is empty, so no endpoint holds more of it than another: balance is all that counts,
        and a hash home would put three agents of four on one server as often as not."""
        healthy = self._healthy_indices()
        start = spread(key, len(self._eps)) if self.spread_first_turns else None
        if start is not None:  # the next admitted endpoint from its spread one, under the bound
            n = len(self._eps)
            bound = self._bound(healthy)
            for i in ((start + k) % n for k in range(n)):
                ep = self._eps[i]
                if not ep.ejected and not self._suspect(ep) and ep.outstanding < bound:
                    return i
        place = {i: n for n, i in enumerate(rank(key, self._names))}
        return min(healthy, key=lambda i: (self._suspect(self._eps[i]),
                                           self._eps[i].outstanding, place[i]))

    def _route(self, key: str, cached_on: str | None = None
               ) -> tuple[_Endpoint, _Endpoint | None]:
        """Where the turn goes, and the home it leaves for load (None: no such move)."""
        if not key or self.routing != "affinity":
            return self._eps[self._least_loaded()], None
        if cached_on not in self._names:  # a first turn: it has no home yet
            return self._eps[self._placed(key)], None
        healthy = set(self._healthy_indices())
        home = self._names.index(cached_on)  # where its last turn ran: its conversation
        order = [home, *(i for i in rank(key, self._names) if i != home)]
        # Home first, then the agent's ranking over admitted endpoints, suspect ones last.
        choices = sorted((i for i in order if i in healthy),
                         key=lambda i: self._suspect(self._eps[i]))
        bound = self._bound(healthy)
        chosen = next((i for i in choices if self._eps[i].outstanding < bound), None)
        if chosen is None:  # every endpoint is past the bound: the least loaded takes it
            chosen = self._least_loaded()
        if chosen == home:
            return self._eps[home], None
        home_ep = self._eps[home]
        why = "failover" if home_ep.ejected or self._suspect(home_ep) else "load"
        self._moves[why] += 1
        for listener in self._move_listeners:
            listener(why)
        if why == "failover":  # rare, and the only record a distributed worker keeps
            log.info("failover: a turn of agent %s moved off %s to %s (%d failover "
                     "moves in this process)", key, home_ep.name, self._eps[chosen].name,
                     self._moves["failover"])
            return self._eps[chosen], None
        return self._eps[chosen], home_ep

    def endpoint_for(self, agent_key: str, cached_on: str | None = None) -> str | None:
        """The endpoint an agent's next turn goes to when no endpoint is past its load bound
        (for tests and debugging): ``cached_on`` while it is admitted and not suspect, else
        where a first turn is placed now; None if every endpoint is ejected or suspect."""
        if cached_on in self._names:
            ep = self._eps[self._names.index(cached_on)]
            if not ep.ejected and not self._suspect(ep):
                return ep.name
        healthy = [i for i in range(len(self._eps)) if not self._eps[i].ejected]
        if not healthy or all(self._suspect(self._eps[i]) for i in healthy):
            return None
        return self._eps[self._placed(agent_key)].name

    def add_move_listener(self, listener: MoveListener) -> None:
        """Call ``listener(reason)`` at each move, in the task that routed the turn (metrics,
        and a distributed batch's stats: ``pool_moves.py``); added once however often given."""
        if listener not in self._move_listeners:
            self._move_listeners.append(listener)

    def moves(self) -> dict[str, int]:
        """Turns routed away from their agent's home endpoint, by why: ``load`` (the home was
        past its bound) and ``failover`` (the home was ejected or had just failed). Each is a
        turn whose prefix was probably not cached where it ran."""
        return {"load": self._moves["load"], "failover": self._moves["failover"]}

    def carries(self) -> dict[str, int]:
        """Load moves whose conversation went with them (``carried``: saved on the home,
        restored where the turn went, so it computed only what was new) and those that
        tried and could not (``not_carried``); ``_carry``."""
        return {"carried": self._carries["carried"], "not_carried": self._carries["not_carried"]}

    async def _carry(self, home: _Endpoint, target: _Endpoint, key: str) -> None:
        """Before a turn moved for load is sent: its agent's conversation saved on the home
        (``save_conversation``) and restored on ``target`` (``restore_conversation``), so
        the turn does not compute it again (llama.cpp: servers sharing a
        ``--slot-save-path``; docs/backends.md). The home names the file (llama.cpp: one
        per slot of it, so no carry in flight, from any process, takes another's); bounded
        by ``CARRY_TIMEOUT_S``. A pair whose restore fails after a save (no shared
        directory) is not tried again; a home that saves nothing costs a call and no I/O."""
        pair = (home.name, target.name)
        if pair in self._no_carry:
            return
        saved = restored = False

        async def carry() -> None:
            nonlocal saved, restored
            name = await home.backend.save_conversation(key)
            saved = name is not None
            restored = name is not None and await target.backend.restore_conversation(key, name)

        try:
            await wait_for(carry(), CARRY_TIMEOUT_S)
        except (asyncio.TimeoutError, BackendError) as exc:
            log.debug("carrying agent %s's conversation %s -> %s failed: %s", key, *pair, exc)
        if not saved:
            return  # nothing held or saved there: nothing tried, nothing counted
        self._carries["carried" if restored else "not_carried"] += 1
        if not restored:
            self._no_carry.add(pair)
            log.info("%s saved a conversation that %s could not restore (no shared slot "
                     "directory?): moves between them are no longer carried", *pair)

    async def complete(self, request: ModelRequest) -> ModelResponse:
        ep, left = self._route(request.agent_key, request.cached_on)
        if left is not None:
            await self._carry(left, ep, request.agent_key)
        if self.hedger is None:
            return await self._attempt(ep, request)
        return await self.hedger.race(
            Attempt(ep.name, lambda: self._attempt(ep, request)),
            lambda bar: self._hedge_to(ep, request, bar))

    def _hedge_to(self, ep: _Endpoint, request: ModelRequest, bar: float) -> Attempt | None:
        """The second request of a turn in flight on ``ep`` past ``bar``: to an admitted
        endpoint other than ``ep`` whose own p95 (where known) is under the bar, suspect ones
        last, then the fewest in flight, ties by the agent's ranking; None if there is none."""
        assert self.hedger is not None
        hedger = self.hedger
        order = rank(request.agent_key, self._names) if request.agent_key else []
        place = {i: n for n, i in enumerate(order)}

        def quick(i: int) -> bool:
            known = hedger.endpoint_p95(self._eps[i].name)
            return known is None or known < bar

        choices = [i for i, other in enumerate(self._eps)
                   if other is not ep and not other.ejected and quick(i)]
        if not choices:
            return None
        best = min(choices, key=lambda i: (self._suspect(self._eps[i]),
                                           self._eps[i].outstanding, place.get(i, i)))
        target = self._eps[best]
        return Attempt(target.name, lambda: self._attempt(target, request))

    async def _attempt(self, ep: _Endpoint, request: ModelRequest) -> ModelResponse:
        """One request of a turn on ``ep``, counted in its load and health (a request
        cancelled because the other of a hedged pair answered first counts as neither)."""
        ep.outstanding += 1
        ep.requests += 1
        try:
            response = await self._watched(ep, request)
        except BackendError as exc:
            self._failed(ep, exc)
            raise
        finally:
            ep.outstanding -= 1
        if not ep.ejected:
            ep.failures = 0
        return response.model_copy(update={"endpoint": ep.name})

    async def _watched(self, ep: _Endpoint, request: ModelRequest) -> ModelResponse:
        """``ep``'s answer, unless ``ep`` is ejected first: then ``BackendUnavailable`` at once,
        so the retry runs elsewhere with the turn's remaining time. A turn in flight for
        ``stall_check_s`` asks the server's health (one check per endpoint at a time): a
        stopped or hung server does not answer it and is ejected, a busy one does."""
        if ep.gone is None or ep.gone.done():
            ep.gone = asyncio.get_running_loop().create_future()
        gone = ep.gone
        call = asyncio.ensure_future(ep.backend.complete(request))
        try:
            while True:
                racing: set[asyncio.Future[Any]] = {call, gone}
                done, _ = await asyncio.wait(racing, timeout=self.stall_check_s,
                                             return_when=asyncio.FIRST_COMPLETED)
                if call in done:
                    return call.result()
                if gone in done:
                    raise BackendUnavailable(
                        f"{ep.name} was ejected while this turn was in flight ({gone.result()})")
                self._start_check(ep, f"a turn in flight for {self.stall_check_s:g}s")
        finally:
            if not call.done():
                call.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await call

    async def complete_batch(self, prompts: list[str], **kwargs: Any) -> list[Any]:
        """Batch prompting on the least-loaded endpoint that supports it."""
        ep = self._eps[self._least_loaded()]
        ep.outstanding += 1
        ep.requests += 1
        try:
            return await ep.backend.complete_batch(prompts, **kwargs)
        finally:
            ep.outstanding -= 1

    # -- health -----------------------------------------------------------------------------

    def _failed(self, ep: _Endpoint, exc: BackendError) -> None:
        ep.errors += 1
        if not isinstance(exc, BackendUnavailable | BackendTimeout):
            ep.failures = 0  # it answered: the server is up, the request was the problem
            return
        ep.failures += 1
        ep.suspect_until = asyncio.get_running_loop().time() + self.probe_interval_s
        if ep.failures >= self.eject_after:
            self._eject(ep, f"{ep.failures} consecutive failures, last: {exc}")
        else:
            self._start_check(ep, str(exc))

    def _start_check(self, ep: _Endpoint, why: str) -> None:
        if ep.check is None and not ep.ejected and not self._closed:
            ep.check = asyncio.get_running_loop().create_task(
                self._check(ep, why), name=f"agentbatch-check-{ep.name}"
            )

    async def _check(self, ep: _Endpoint, error: str) -> None:
        """After a failure or a stall: a server that does not answer its health check either
        (killed, stopped) is ejected now, without waiting for ``eject_after`` failed turns."""
        try:
            if not await self._healthy(ep):
                self._eject(ep, f"health check failed after: {error}")
        finally:
            ep.check = None

    def _eject(self, ep: _Endpoint, reason: str) -> None:
        if ep.ejected or self._closed:
            return
        ep.ejected = True
        ep.ejections += 1
        if ep.gone is not None and not ep.gone.done():
            ep.gone.set_result(reason)  # its turns in flight move now
        log.warning("endpoint %s ejected (%s)", ep.name, reason)
        ep.probe = asyncio.get_running_loop().create_task(
            self._probe(ep), name=f"agentbatch-probe-{ep.name}"
        )

    async def _healthy(self, ep: _Endpoint) -> bool:
        try:  # a backend with nothing to ask says True: real traffic decides
            return bool(await ep.backend.health())
        except Exception:
            return False

    async def _probe(self, ep: _Endpoint) -> None:
        while not self._closed:
            await self._sleep(self.probe_interval_s)
            if self._closed:
                return
            if await self._healthy(ep):
                ep.ejected = False
                ep.failures = 0
                ep.probe = None
                log.info("endpoint %s re-admitted", ep.name)
                return

    async def probe_all(self) -> dict[str, bool]:
        """Check every admitted endpoint now; eject those whose health probe fails."""
        admitted = [ep for ep in self._eps if not ep.ejected]
        results = await asyncio.gather(*(self._healthy(ep) for ep in admitted))
        for ep, ok in zip(admitted, results, strict=True):
            if not ok:
                self._eject(ep, "health probe failed")
        return {ep.name: not ep.ejected for ep in self._eps}

    async def health(self) -> bool:
        return any((await self.probe_all()).values())

    # -- the rest of the Backend surface -----------------------------------------------------

    async def warm(self, request: ModelRequest) -> None:
        """Warm every endpoint; one that fails is ejected. Fails only if NONE warms."""
        targets = self._eps  # one with nothing to warm (the default ``warm``) succeeds
        results = await asyncio.gather(
            *(ep.backend.warm(request) for ep in targets),
            return_exceptions=True,
        )
        failures = [
            (ep, r) for ep, r in zip(targets, results, strict=True) if isinstance(r, BaseException)
        ]
        for ep, error in failures:
            if not isinstance(error, Exception):
                raise error  # cancellation and friends
            self._eject(ep, f"warm-up failed: {error}")
        if len(failures) == len(targets):
            detail = "; ".join(f"{ep.name}: {err}" for ep, err in failures)
            raise BackendUnavailable(f"no endpoint warmed up: {detail}")

    async def context_length(self) -> int | None:
        """The smallest context any endpoint states: a turn may be routed to any of them."""
        found = await asyncio.gather(*(ep.backend.context_length() for ep in self._eps),
                                     return_exceptions=True)
        lengths = [n for n in found if isinstance(n, int)]
        return min(lengths) if lengths else None

    async def count_tokens(self, prompt: str | list[Message],
                           tools: list[dict[str, Any]] | None = None) -> int | None:
        """The first admitted endpoint's count (they serve one model: one tokenizer)."""
        for ep in self._eps:
            if not ep.ejected:
                return await ep.backend.count_tokens(prompt, tools)
        return None

    async def fetch_load(self) -> ServerLoad | None:
        """Summed running/waiting over admitted endpoints; the mean prefix-cache hit rate."""
        eps = [ep for ep in self._eps if not ep.ejected]  # the default ``fetch_load`` says None
        loads = await asyncio.gather(
            *(ep.backend.fetch_load() for ep in eps),
            return_exceptions=True,
        )
        found = [x for x in loads if isinstance(x, ServerLoad)]
        if not found:
            return None
        rates = [x.prefix_cache_hit_rate for x in found if x.prefix_cache_hit_rate is not None]
        return ServerLoad(
            running=sum(x.running for x in found),
            waiting=sum(x.waiting for x in found),
            prefix_cache_hit_rate=sum(rates) / len(rates) if rates else None,
        )

    def hedge_stats(self) -> dict[str, Any] | None:
        """The ``Hedger``'s counters (``hedge.py``); None without ``hedge_after``."""
        return self.hedger.stats() if self.hedger is not None else None

    def stats(self) -> dict[str, dict[str, int | bool]]:
        """Per endpoint: requests, errors, ejections, outstanding, ejected."""
        return {
            ep.name: {
                "requests": ep.requests,
                "errors": ep.errors,
                "ejections": ep.ejections,
                "outstanding": ep.outstanding,
                "ejected": ep.ejected,
            }
            for ep in self._eps
        }

    async def aclose(self) -> None:
        """Stop the probes and close every endpoint (errors closing one do not stop the rest)."""
        self._closed = True
        probes = [t for ep in self._eps for t in (ep.probe, ep.check) if t is not None]
        for task in probes:
            task.cancel()
        for task in probes:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for ep in self._eps:
            ep.probe = ep.check = None
        results = await asyncio.gather(
            *(ep.backend.aclose() for ep in self._eps), return_exceptions=True
        )
        for ep, result in zip(self._eps, results, strict=True):
            if isinstance(result, Exception):
                log.warning("closing %s failed: %s", ep.name, result)
