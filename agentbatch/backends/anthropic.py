"""The Anthropic Messages API backend, over plain httpx (no SDK to pin or to fight).

``anthropic://`` talks to https://api.anthropic.com; ``anthropic://host:port`` to a compatible
endpoint or proxy (plain http on loopback). The key comes from ``api_key``, or
``ANTHROPIC_API_KEY`` for api.anthropic.com only, or for another host from the variable that
``AGENTBATCH_API_KEYS`` / ``?api_key_env=`` names (``api_keys``). It is checked at
construction, so a batch fails before its fan-out rather than on every agent; a proxy that
needs no key still wants a placeholder value.

Errors: 429 is ``RateLimited`` and 529 ("overloaded") a ``ServerError`` -- both retryable with
the server's ``retry-after``; other 5xx are ``ServerError``; other 4xx ``BadRequest`` with the
API's own message. The key is scrubbed from every message.
"""

from __future__ import annotations

from typing import Any

import httpx

from agentbatch.backends.anthropic_convert import DEFAULT_MAX_TOKENS, build_body, parse_response
from agentbatch.backends.api_keys import API_KEYS_ENV
from agentbatch.backends.base import Backend, BackendCapabilities
from agentbatch.backends.http_session import HttpSession
from agentbatch.backends.urls import ANTHROPIC_HOST, BackendTarget, parse_backend_url
from agentbatch.core.errors import ConfigError
from agentbatch.core.model_io import ModelRequest, ModelResponse

ANTHROPIC_KEY_ENV = "ANTHROPIC_API_KEY"
ANTHROPIC_VERSION = "2023-06-01"
DEFAULT_TIMEOUT_S = 300.0

CAPABILITIES = BackendCapabilities(
    native_json_schema=False,
    prefix_warming=False,
    batch_prompting=False,
    max_safe_concurrency=16,
)


class AnthropicBackend(Backend):
    """``Backend`` over ``POST {base}/v1/messages``."""

    def __init__(
        self,
        target: BackendTarget | str = "anthropic://",
        *,
        timeout: float | None = None,
        max_connections: int = 1000,
        api_key: str | None = None,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if isinstance(target, str):
            target = parse_backend_url(target, api_key=api_key)
        if target.scheme != "anthropic":
            raise ConfigError(f"AnthropicBackend needs an anthropic:// URL, got {target.display}")
        key = api_key or target.api_key
        if key is None:
            raise ConfigError(
                f"{target.display} needs an API key: set the {ANTHROPIC_KEY_ENV} environment "
                f"variable (sent to {ANTHROPIC_HOST} only), or name one for this host with "
                f"{API_KEYS_ENV} or ?api_key_env="
            )
        self.target = target
        self.name = target.display
        self.capabilities = CAPABILITIES
        self.timeout = float(timeout) if timeout else DEFAULT_TIMEOUT_S
        self.default_max_tokens = default_max_tokens
        self._api_key = key
        self._session = HttpSession(
            target.base_url,
            who=self.name,
            headers={
                "User-Agent": "agentbatch",
                "x-api-key": key,
                "anthropic-version": ANTHROPIC_VERSION,
            },
            timeout=self.timeout,
            max_connections=max_connections,
            secret=key,
            transport=transport,
        )

    def __repr__(self) -> str:
        return f"AnthropicBackend({self.name!r})"

    @property
    def requests_sent(self) -> int:
        return self._session.requests_sent

    def build_body(self, request: ModelRequest, *,
                   cache_ttl: str | None = None) -> dict[str, Any]:
        """The JSON body for one Messages call (public so tests and tools can inspect it);
        ``cache_ttl="1h"`` for the 1-hour prompt cache (provider batch turns)."""
        model = request.model or self.target.model or ""
        return build_body(request, model=model, default_max_tokens=self.default_max_tokens,
                          cache_ttl=cache_ttl)

    async def complete(self, request: ModelRequest) -> ModelResponse:
        """One model turn. Raises ``BackendError`` subclasses, never httpx exceptions."""
        timeout = request.timeout_s or self.timeout
        body = await self._session.post_json("/v1/messages", self.build_body(request), {}, timeout)
        return parse_response(body, who=self.name)

    async def aclose(self) -> None:
        await self._session.aclose()

    async def __aenter__(self) -> AnthropicBackend:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
