"""Several endpoints of one model as one ``Backend``: least-outstanding routing with affinity.

An agent's turns share an ever-growing prefix, so sending them to the same server keeps its
prefix cache hot; new agents go to the endpoint with the fewest requests in flight (ties
rotate). An endpoint that fails ``eject_after`` times in a row with a connection error or a
timeout is ejected: nothing new is routed to it, and a background probe (``health()`` of the
inner backend, every ``probe_interval_s``) re-admits it once it answers again.

The pool never retries by itself: the ``RetryingBackend`` around it does, and each retry is
routed afresh. An agent whose endpoint refused a connection loses its affinity at once, and
endpoints with a failure streak come last in routing, so its retry goes elsewhere even before
the endpoint is ejected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import BackendError, BackendTimeout, BackendUnavailable, BatchSpecError
from ..model_io import Message, ModelRequest, ModelResponse
from .base import Backend, ServerLoad

log = logging.getLogger(__name__)

SleepFn = Callable[[float], Awaitable[None]]
MAX_AFFINITY = 100_000


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
    probe: asyncio.Task[None] | None = None


class EndpointPool(Backend):
    """A ``Backend`` over several endpoints; see the module docstring."""

    def __init__(
        self,
        backends: list[Backend],
        *,
        eject_after: int = 3,
        probe_interval_s: float = 2.0,
        max_affinity: int = MAX_AFFINITY,
        sleep: SleepFn | None = None,
    ) -> None:
        if not backends:
            raise ValueError("EndpointPool needs at least one backend")
        if eject_after < 1:
            raise ValueError("eject_after must be >= 1")
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
        self.max_affinity = max_affinity
        self._sleep: SleepFn = sleep or asyncio.sleep
        self._affinity: OrderedDict[str, int] = OrderedDict()
        self._turn = 0
        self._closed = False

    @property
    def backends(self) -> list[Backend]:
        return [ep.backend for ep in self._eps]

    def __repr__(self) -> str:
        return f"EndpointPool({self.name!r})"

    # -- routing ----------------------------------------------------------------------------

    def _least_loaded(self) -> int:
        healthy = [i for i, ep in enumerate(self._eps) if not ep.ejected]
        if not healthy:
            raise BackendUnavailable(
                f"all {len(self._eps)} endpoints are ejected: "
                + ", ".join(ep.name for ep in self._eps)
            )
        n, start = len(self._eps), self._turn
        self._turn = (self._turn + 1) % n
        # An endpoint that just failed (not yet ejected) is the last choice, so a retry after a
        # refused connection goes elsewhere; then fewest in flight; ties rotate.
        return min(
            healthy,
            key=lambda i: (self._eps[i].failures > 0, self._eps[i].outstanding, (i - start) % n),
        )

    def _route(self, key: str) -> _Endpoint:
        if key:
            index = self._affinity.get(key)
            if index is not None and not self._eps[index].ejected:
                self._affinity.move_to_end(key)
                return self._eps[index]
        index = self._least_loaded()
        if key:
            self._affinity[key] = index
            self._affinity.move_to_end(key)
            while len(self._affinity) > self.max_affinity:
                self._affinity.popitem(last=False)
        return self._eps[index]

    def endpoint_for(self, agent_key: str) -> str | None:
        """The endpoint name an agent is pinned to, if any (for tests and debugging)."""
        index = self._affinity.get(agent_key)
        return None if index is None else self._eps[index].name

    async def complete(self, request: ModelRequest) -> ModelResponse:
        ep = self._route(request.agent_key)
        ep.outstanding += 1
        ep.requests += 1
        try:
            response = await ep.backend.complete(request)
        except BackendError as exc:
            self._failed(ep, exc, request.agent_key)
            raise
        finally:
            ep.outstanding -= 1
        if not ep.ejected:
            ep.failures = 0
        return response

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

    def _failed(self, ep: _Endpoint, exc: BackendError, key: str) -> None:
        ep.errors += 1
        if not isinstance(exc, BackendUnavailable | BackendTimeout):
            ep.failures = 0  # it answered: the server is up, the request was the problem
            return
        pinned = self._affinity.get(key) if key else None
        if isinstance(exc, BackendUnavailable) and pinned == self._eps.index(ep):
            del self._affinity[key]
        ep.failures += 1
        if ep.failures >= self.eject_after:
            self._eject(ep, f"{ep.failures} consecutive failures, last: {exc}")

    def _eject(self, ep: _Endpoint, reason: str) -> None:
        if ep.ejected or self._closed:
            return
        ep.ejected = True
        ep.ejections += 1
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
        probes = [ep.probe for ep in self._eps if ep.probe is not None]
        for task in probes:
            task.cancel()
        for task in probes:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for ep in self._eps:
            ep.probe = None
        results = await asyncio.gather(
            *(ep.backend.aclose() for ep in self._eps), return_exceptions=True
        )
        for ep, result in zip(self._eps, results, strict=True):
            if isinstance(result, Exception):
                log.warning("closing %s failed: %s", ep.name, result)
