"""Open the backend a batch runs against, and warm its prefix cache before the fan-out.

The wrapping order is deliberate: ``RetryingBackend`` outermost (retries every transient
failure), then the ``EndpointPool`` for several URLs (routes each attempt, so a retry after a
dead endpoint lands on a live one), then per hosted endpoint an ``AdaptiveBackend`` (AIMD:
each throttle shrinks concurrency, and each retry queues at the reduced limit). Self-hosted
servers get no AIMD: their queue is visible in ``/metrics`` and they do not throttle.

A URL written ``@path`` names a hostfile (see ``pool.parse_hostfile``): one URL or bare
``host:port`` per line, bare entries taken as generic ``http://`` OpenAI-compatible servers.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from agentbatch.backends.aimd import AdaptiveBackend, AIMDController
from agentbatch.backends.base import Backend, BackendWrapper
from agentbatch.backends.registry import backend_from_url
from agentbatch.backends.retry import RetryingBackend, RetryPolicy
from agentbatch.core.errors import BackendError, BackendUnavailable, BatchSpecError
from agentbatch.core.options import DEFAULT_MAX_INFLIGHT, DEFAULT_POOL_LOAD_FACTOR
from agentbatch.core.wait_for import wait_for

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from agentbatch.core.plan import BatchPlan

HOSTED_SCHEMES = ("openai", "anthropic", "bedrock")
HOSTFILE_DEFAULT_SCHEME = "http"


def expand_backend_urls(urls: list[str]) -> list[str]:
    """``urls`` with every ``@path`` hostfile replaced by the URLs it lists."""
    from agentbatch.backends.pool import parse_hostfile

    out: list[str] = []
    for url in urls:
        if url.startswith("@"):
            out.extend(parse_hostfile(url[1:], default_scheme=HOSTFILE_DEFAULT_SCHEME))
        else:
            out.append(url)
    return out


def _scheme(url: str) -> str:
    return url.split("://", 1)[0].partition("+")[0].strip().lower()


def open_endpoint(
    url: str, *, timeout: float | None = None, trust_key_env: bool = True
) -> Backend:
    """One endpoint: the driver for ``url``, under AIMD when it is a hosted API."""
    backend = backend_from_url(url, timeout=timeout, trust_key_env=trust_key_env)
    if _scheme(url) in HOSTED_SCHEMES:
        safe = backend.capabilities.max_safe_concurrency
        controller = AIMDController(initial=safe, maximum=max(64, safe))
        backend = AdaptiveBackend(backend, controller)
    return backend


def open_backend(
    urls: list[str], *, timeout: float | None = None, policy: RetryPolicy | None = None,
    batch_prompting: bool = False, trust_key_env: bool = True,
    pool_routing: str = "affinity", pool_load_factor: float = DEFAULT_POOL_LOAD_FACTOR,
) -> Backend:
    """One retrying backend for the batch's URL (or its pool of URLs / ``@hostfile``).

    ``batch_prompting`` gathers concurrent tool-free turns into one ``/v1/completions``
    request (``MicroBatchingBackend``), under the retry layer so a prompt whose fallback
    fails is retried in a later batch. Workers pass ``trust_key_env=False``: a plan written by
    someone else may not choose which of the worker's variables is sent as a key
    (``api_keys``). ``pool_routing`` and ``pool_load_factor`` (the batch options) set how a
    pool of several URLs routes each turn (``EndpointPool``)."""
    urls = expand_backend_urls(urls)
    if len(urls) == 1:
        inner = open_endpoint(urls[0], timeout=timeout, trust_key_env=trust_key_env)
    else:
        from agentbatch.backends.pool import EndpointPool

        # Drivers connect lazily, so an error opening a later URL leaves nothing to close.
        inner = EndpointPool(
            [open_endpoint(u, timeout=timeout, trust_key_env=trust_key_env) for u in urls],
            routing=pool_routing, load_factor=pool_load_factor,
        )
    if batch_prompting:
        from agentbatch.backends.microbatch import MicroBatchingBackend

        inner = MicroBatchingBackend(inner)
    return RetryingBackend(inner, policy or RetryPolicy())


def check_batch_prompting(urls: list[str], *, has_tools: bool) -> None:
    """``batch_prompting=True`` must be able to batch something, or it is refused at submit.

    Native tool turns never travel as a raw prompt (``microbatch.batchable``; pass
    ``has_tools`` False for ``tool_calling="json"``, whose turns are text), and a backend that
    does not declare ``capabilities.batch_prompting`` (its promise to implement
    ``complete_batch``) would pass every turn straight through:
    either way the option would silently do nothing.
    """
    if has_tools:
        raise BatchSpecError(
            "batch_prompting=True cannot apply to a batch with tools: native tool turns need "
            "the server's chat endpoint (its template and tool-call parser), so no turn would "
            "be batched; drop batch_prompting, or use tool_calling='json'"
        )
    for url in expand_backend_urls(urls):
        backend = backend_from_url(url)  # drivers connect lazily: nothing to close here
        if not backend.capabilities.batch_prompting:
            raise BatchSpecError(
                f"batch_prompting=True cannot apply to backend {backend.name}: it does not "
                "take a list of prompts on /v1/completions (batch prompting is available on "
                "vllm://, sglang://, llamacpp:// and sim:// URLs)"
            )


def endpoints(backend: Backend) -> list[Backend]:
    """The endpoint drivers under the wrapping layers (several for an ``EndpointPool``)."""
    from agentbatch.backends.pool import EndpointPool

    while isinstance(backend, BackendWrapper):
        backend = backend.inner
    if isinstance(backend, EndpointPool):
        return [e for member in backend.backends for e in endpoints(member)]
    return [backend]


def pool_stats(backend: Backend) -> dict[str, object] | None:
    """Routing counters of the ``EndpointPool`` under the wrapping layers, for
    ``handle.stats()["pool"]``: per endpoint (requests, errors, ejections, ejected) and the
    turns moved off their agent's home endpoint (``EndpointPool.moves``), those whose
    conversation went with them (``EndpointPool.carries``), and with
    ``hedge_after`` the hedging counters (``hedge.Hedger.stats``); None for one URL."""
    from agentbatch.backends.pool import pool_under

    pool = pool_under(backend)
    if pool is None:
        return None
    return {"endpoints": pool.stats(), "moves": pool.moves(),
            "carries": pool.carries(), "hedge": pool.hedge_stats()}


def spread_first_turns(backend: Backend) -> None:
    """A distributed worker's pool places first turns by the agent's number, as every other
    worker's does (``EndpointPool.spread_first_turns``): its own turns in flight are not the
    fleet's. Nothing for one URL."""
    from agentbatch.backends.pool import pool_under

    pool = pool_under(backend)
    if pool is not None:
        pool.spread_first_turns = True


def inflight_hint(backend: Backend) -> int | None:
    """The most requests worth having in flight on ``backend``, from what its servers said at
    preflight (``inflight_hint`` of each endpoint, e.g. llama.cpp's slot count), summed over
    a pool; None if some endpoint has no opinion.

    More than that only waits in the server's own first-come queue, where the embedded
    engine's near-done-first order cannot reach it: holding the rest in agentbatch's queue
    sends an agent's next turn ahead of other agents' first turns (``PrioritySlots``).
    """
    total = 0
    for endpoint in endpoints(backend):
        hint = endpoint.inflight_hint
        if not isinstance(hint, int) or hint < 1:
            return None
        total += hint
    return total


def inflight_limit(plan: BatchPlan, backend: Backend) -> int:
    """The turns a batch keeps in flight on ``backend`` (both engines): the plan's
    ``max_inflight``, else the backend's safe concurrency, capped by what its servers said
    (``inflight_hint``) and by ``DEFAULT_MAX_INFLIGHT``."""
    return plan.max_inflight or min(backend.capabilities.max_safe_concurrency,
                                    DEFAULT_MAX_INFLIGHT,
                                    inflight_hint(backend) or DEFAULT_MAX_INFLIGHT)


async def learn_inflight_hint(backend: Backend, timeout_s: float = 10.0) -> None:
    """Ask each endpoint that can tell how many requests it serves at once (a driver's
    ``learn_inflight_hint``, e.g. llama.cpp's ``/props``) where no preflight ran: a worker.
    A server that does not answer in ``timeout_s`` leaves the hint unknown (the default cap
    applies); its turns then fail or succeed on their own."""
    for endpoint in endpoints(backend):
        if endpoint.inflight_hint is not None:
            continue
        try:  # the default ``learn_inflight_hint`` learns nothing, at once
            await wait_for(endpoint.learn_inflight_hint(), timeout_s)
        except Exception as exc:  # only a hint: the turn reports real errors
            log.info("%s did not say how many requests it serves at once: %s",
                     endpoint.name, exc)


async def preflight_backend(backend: Backend, plan: BatchPlan) -> None:
    """Before anything is dispatched: each endpoint is the server its URL says (a driver's own
    ``preflight``, e.g. llama.cpp's ``/props``), and ``max_server_waiting`` has a queue gauge
    to read on every endpoint. Raises ``ConfigError`` / ``BatchSpecError``."""
    for endpoint in endpoints(backend):
        await endpoint.preflight(plan)  # the default checks nothing
        if plan.max_server_waiting is not None:
            await _check_queue_gauge(endpoint, plan.max_server_waiting)


async def slot_pinning(backend: Backend) -> dict[str, int]:
    """The endpoints that pin turns to slots after their warm-up (``Backend.pinned_slots``),
    by name, with their slot counts: what a distributed batch's workers pin by
    (``BatchPlan.pinned_slots``)."""
    found: dict[str, int] = {}
    for endpoint in endpoints(backend):
        slots = await endpoint.pinned_slots()
        if slots:
            found[endpoint.name] = slots
    return found


async def _check_queue_gauge(endpoint: Backend, max_waiting: int) -> None:
    load = await endpoint.fetch_load()  # the default (no server metrics) says None
    if load is None or not load.queue_known:
        raise BatchSpecError(
            f"max_server_waiting={max_waiting} cannot apply to backend {endpoint.name}: it "
            "publishes no server metrics, or its /metrics did not answer with a queue gauge "
            "agentbatch understands (vllm:num_requests_waiting, sglang:num_queue_reqs, "
            "llamacpp:requests_deferred, dynamo_frontend_queued_requests); drop "
            "max_server_waiting or point it at a server that publishes its queue"
        )


async def warm_backend(backend: Backend, plan: BatchPlan) -> None:
    """Send the shared prefix once so the server caches it; an unreachable server fails here,
    before any agent is dispatched."""
    from agentbatch.core.render import warmup_request

    if not backend.capabilities.prefix_warming:
        return
    try:
        await backend.warm(warmup_request(plan))  # the default warms nothing
    except BackendError as exc:
        raise BackendUnavailable(
            f"backend {', '.join(plan.backends)} failed the warm-up request: {exc}"
        ) from exc
