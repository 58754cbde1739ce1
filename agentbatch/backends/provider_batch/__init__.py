"""Provider batch APIs (half price, minutes-to-hours latency) behind one client interface.

``batch_client(backend)`` is the warm-up hook: the client for the backend's kind when its
server has the API (asked over HTTP, or for ``bedrock://`` through boto3), else None; a
``BatchSpecError`` naming what is missing when the API exists but is not configured (Bedrock's
S3 location and service role, ``bedrock_batch``). A client's API is the seam the engines use:
``submit([(custom_id, ModelRequest), ...])``, ``wait(batch_id, timeout_s=...)``,
``results(batch_id, custom_ids)`` -> ``{custom_id: ItemResult}``, ``cancel(batch_id)``.
"""

from __future__ import annotations

from agentbatch.backends.anthropic import AnthropicBackend
from agentbatch.backends.base import Backend
from agentbatch.backends.bedrock import BedrockBackend
from agentbatch.backends.openai_compat import OpenAICompatBackend
from agentbatch.backends.provider_batch.anthropic_batch import AnthropicBatchClient
from agentbatch.backends.provider_batch.bedrock_batch import (
    BedrockBatchClient,
    bedrock_batch_client,
)
from agentbatch.backends.provider_batch.client import ProviderBatchClient
from agentbatch.backends.provider_batch.openai_batch import OpenAIBatchClient
from agentbatch.backends.provider_batch.types import (
    BatchState,
    ItemError,
    ItemErrorKind,
    ItemResult,
)

__all__ = ["AnthropicBatchClient", "BatchState", "BedrockBatchClient", "ItemError",
           "ItemErrorKind", "ItemResult", "OpenAIBatchClient", "ProviderBatchClient",
           "batch_client"]


async def batch_client(backend: Backend) -> ProviderBatchClient | None:
    """The batch client for ``backend`` when its server has a batch API, else None.
    ``BatchSpecError`` for ``bedrock://`` without the batch configuration (or the permission
    to use it), naming what is missing; a retryable ``BackendError`` when AWS is not
    answering."""
    client: ProviderBatchClient
    if isinstance(backend, BedrockBackend):
        bedrock = bedrock_batch_client(backend)
        try:
            await bedrock.discover()
        except BaseException:
            await bedrock.aclose()
            raise
        return bedrock
    if isinstance(backend, AnthropicBackend):
        client = AnthropicBatchClient(backend)
    elif isinstance(backend, OpenAICompatBackend):
        client = OpenAIBatchClient(backend)
    else:
        return None
    if await client.discover():
        return client
    await client.aclose()
    return None
