"""The one small interface every inference backend implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ..model_io import ModelRequest, ModelResponse


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend can do beyond plain chat completions; the engines adapt to these."""

    native_json_schema: bool = False  # honours response_format json_schema / guided JSON
    prefix_cache_metrics: bool = False  # exposes /metrics with prefix-cache hit rate
    prefix_warming: bool = False  # a warm-up request populates a server-side prefix cache
    batch_prompting: bool = False  # /v1/completions accepts a list of prompts
    agent_hints: bool = False  # accepts per-request scheduling hints (Dynamo nvext)
    max_safe_concurrency: int = 256  # a sensible default for max_inflight


@dataclass(frozen=True)
class ServerLoad:
    """A snapshot of the server's own queue, for backpressure."""

    running: float = 0.0
    waiting: float = 0.0
    prefix_cache_hit_rate: float | None = None


@runtime_checkable
class Backend(Protocol):
    """A model server. ``complete`` raises ``agentbatch.errors.BackendError`` subclasses."""

    name: str
    capabilities: BackendCapabilities

    async def complete(self, request: ModelRequest) -> ModelResponse: ...

    async def aclose(self) -> None: ...
