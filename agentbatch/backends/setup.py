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

from typing import TYPE_CHECKING

from ..errors import BackendError, BackendUnavailable
from .aimd import AdaptiveBackend, AIMDController
from .base import Backend
from .registry import backend_from_url
from .retry import RetryingBackend, RetryPolicy

if TYPE_CHECKING:
    from ..orchestrator.plan import BatchPlan

HOSTED_SCHEMES = ("openai", "anthropic", "bedrock")
HOSTFILE_DEFAULT_SCHEME = "http"


def expand_backend_urls(urls: list[str]) -> list[str]:
    """``urls`` with every ``@path`` hostfile replaced by the URLs it lists."""
    from .pool import parse_hostfile

    out: list[str] = []
    for url in urls:
        if url.startswith("@"):
            out.extend(parse_hostfile(url[1:], default_scheme=HOSTFILE_DEFAULT_SCHEME))
        else:
            out.append(url)
    return out


def _scheme(url: str) -> str:
    return url.split("://", 1)[0].partition("+")[0].strip().lower()


def open_endpoint(url: str, *, timeout: float | None = None) -> Backend:
    """One endpoint: the driver for ``url``, under AIMD when it is a hosted API."""
    backend = backend_from_url(url, timeout=timeout)
    if _scheme(url) in HOSTED_SCHEMES:
        safe = backend.capabilities.max_safe_concurrency
        controller = AIMDController(initial=safe, maximum=max(64, safe))
        backend = AdaptiveBackend(backend, controller)
    return backend


def open_backend(
    urls: list[str], *, timeout: float | None = None, policy: RetryPolicy | None = None,
    batch_prompting: bool = False,
) -> Backend:
    """One retrying backend for the batch's URL (or its pool of URLs / ``@hostfile``).

    ``batch_prompting`` gathers concurrent tool-free turns into one ``/v1/completions``
    request (``MicroBatchingBackend``), under the retry layer so a prompt whose fallback
    fails is retried in a later batch."""
    urls = expand_backend_urls(urls)
    if len(urls) == 1:
        inner = open_endpoint(urls[0], timeout=timeout)
    else:
        from .pool import EndpointPool

        # Drivers connect lazily, so an error opening a later URL leaves nothing to close.
        inner = EndpointPool([open_endpoint(u, timeout=timeout) for u in urls])
    if batch_prompting:
        from .microbatch import MicroBatchingBackend

        inner = MicroBatchingBackend(inner)
    return RetryingBackend(inner, policy or RetryPolicy())


async def warm_backend(backend: Backend, plan: BatchPlan) -> None:
    """Send the shared prefix once so the server caches it; an unreachable server fails here,
    before any agent is dispatched."""
    from ..orchestrator.render import warmup_request

    if not backend.capabilities.prefix_warming:
        return
    warm = getattr(backend, "warm", None)
    if warm is None:
        return
    try:
        await warm(warmup_request(plan))
    except BackendError as exc:
        raise BackendUnavailable(
            f"backend {', '.join(plan.backends)} failed the warm-up request: {exc}"
        ) from exc
