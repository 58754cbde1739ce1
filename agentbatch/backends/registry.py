"""From a backend URL to a ready ``Backend``.

Drivers are looked up by scheme and imported only when used, so an optional dependency
(boto3 for Bedrock, say) is needed only by batches that actually talk to that service.
"""

from __future__ import annotations

import importlib
from typing import Any

from agentbatch.backends.base import Backend
from agentbatch.backends.urls import STREAMABLE_SCHEMES, BackendTarget, parse_backend_url
from agentbatch.core.errors import ConfigError

# scheme -> "module:factory"; the factory is called as factory(target, **options).
_DRIVERS: dict[str, str] = {
    "vllm": "agentbatch.backends.vllm:VLLMBackend",
    "sglang": "agentbatch.backends.openai_compat:OpenAICompatBackend",
    "sim": "agentbatch.backends.openai_compat:OpenAICompatBackend",
    "http": "agentbatch.backends.openai_compat:OpenAICompatBackend",
    "openai": "agentbatch.backends.openai_compat:OpenAICompatBackend",
    "dynamo": "agentbatch.backends.openai_compat:DynamoBackend",
    "llamacpp": "agentbatch.backends.llamacpp:LlamaCppBackend",
    "anthropic": "agentbatch.backends.anthropic:AnthropicBackend",
    "bedrock": "agentbatch.backends.bedrock:BedrockBackend",
}


def register_driver(scheme: str, factory_path: str) -> None:
    """Route ``scheme`` to ``"module:factory"`` (how the Anthropic/Bedrock drivers plug in)."""
    _DRIVERS[scheme] = factory_path


def _load(scheme: str, path: str) -> Any:
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"the {scheme}:// backend needs an optional dependency that is not installed "
            f"({exc.name or exc}); try: pip install 'agentbatch[all]'"
        ) from exc
    return getattr(module, attr)


def backend_from_url(
    url: str,
    *,
    timeout: float | None = None,
    max_connections: int = 1000,
    api_key: str | None = None,
    trust_key_env: bool = True,
) -> Backend:
    """A backend for ``url`` (see ``urls.KNOWN_SCHEMES``).

    ``timeout`` is the default per-turn deadline in seconds (a request's own ``timeout_s``
    wins); ``api_key`` overrides the environment. ``?stream=1`` or ``?stream=0`` on an
    OpenAI-compatible URL builds the driver with ``stream=True`` or ``False`` (only then is
    ``stream`` passed, so drivers that cannot stream need not accept it, and a driver keeps
    its own default without it). ``trust_key_env=False`` on workers: see
    ``parse_backend_url``. Raises ``BatchSpecError`` for a malformed
    URL and ``ConfigError`` for a missing key or an unavailable driver.
    """
    target: BackendTarget = parse_backend_url(url, api_key=api_key, trust_key_env=trust_key_env)
    path = _DRIVERS.get(target.scheme)
    if path is None:
        raise ConfigError(f"the {target.scheme}:// backend is not implemented yet")
    factory = _load(target.scheme, path)
    options: dict[str, Any] = {}
    if target.stream is not None and target.scheme in STREAMABLE_SCHEMES:
        options["stream"] = target.stream
    return factory(
        target, timeout=timeout, max_connections=max_connections, api_key=api_key, **options
    )
