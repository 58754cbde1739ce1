"""The backend's provider batch API for ``pricing="batch"`` / ``"auto"``, found (or refused)
at submit: one check for both engines."""

from __future__ import annotations

from agentbatch.backends.base import Backend
from agentbatch.backends.provider_batch import ProviderBatchClient, batch_client
from agentbatch.backends.setup import endpoints
from agentbatch.core.errors import BatchSpecError


async def require_batch_client(backend: Backend, backends: list[str],
                               pricing: str) -> ProviderBatchClient:
    """The batch client of ``backend`` (the driver under the retry layer; not a pool, yet),
    or a ``BatchSpecError`` naming ``pricing`` before anything is enqueued."""
    drivers = endpoints(backend)
    client = await batch_client(drivers[0]) if len(drivers) == 1 else None
    if client is None:
        raise BatchSpecError(
            f"pricing={pricing!r}: backend {', '.join(backends)} has no provider batch API "
            "(OpenAI's /v1/batches or Anthropic's /v1/messages/batches did not answer at "
            "warm-up, or it is a pool of several URLs); use pricing='sync'; nothing was "
            "enqueued")
    return client
