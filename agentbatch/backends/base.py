"""The one small interface every inference backend implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from ..model_io import ModelRequest, ModelResponse


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend can do beyond plain chat completions; the engines adapt to these."""

    native_json_schema: bool = False  # honours response_format json_schema / guided JSON
    prefix_cache_metrics: bool = False  # exposes /metrics with prefix-cache hit rate
    prefix_warming: bool = False  # a warm-up request populates a server-side prefix cache
    batch_prompting: bool = False  # /v1/completions accepts a list of prompts
    # tool_choice="required" actually forces a tool call (llama.cpp's grammar does not)
    tool_choice_required: bool = True
    agent_hints: bool = False  # accepts per-request scheduling hints (Dynamo nvext)
    max_safe_concurrency: int = 256  # a sensible default for max_inflight


@dataclass(frozen=True)
class ServerLoad:
    """A snapshot of the server's own queue, for backpressure."""

    running: float = 0.0
    waiting: float = 0.0
    prefix_cache_hit_rate: float | None = None
    queue_known: bool = True  # False: /metrics had no running/waiting gauge we understand


@runtime_checkable
class Backend(Protocol):
    """A model server. ``complete`` raises ``agentbatch.errors.BackendError`` subclasses."""

    name: str
    capabilities: BackendCapabilities

    async def complete(self, request: ModelRequest) -> ModelResponse: ...

    async def aclose(self) -> None: ...


class BackendWrapper:
    """Base of the layers that wrap a backend (retries, AIMD, micro-batching).

    Everything a layer does not override is the inner backend's: its name, capabilities,
    ``warm``, ``fetch_load``, counters.
    """

    def __init__(self, inner: Backend) -> None:
        self._inner = inner

    @property
    def inner(self) -> Backend:
        return self._inner

    @property
    def name(self) -> str:
        return self._inner.name

    @property
    def capabilities(self) -> BackendCapabilities:
        return self._inner.capabilities

    async def aclose(self) -> None:
        await self._inner.aclose()

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes not found normally; ``_inner`` itself missing (e.g.
        # while unpickling) must not recurse.
        if name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)
