"""The one base class every inference backend inherits: ``complete``, ``aclose`` and the hooks
the engines call, each declared here with a default that means "not supported".

Call sites call the hooks as plain methods (no ``getattr``), so renaming one is a type error
and a test failure (``tests/unit/test_backend_hooks.py``), never a feature silently off.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentbatch.core.errors import BackendError
from agentbatch.core.model_io import Message, ModelRequest, ModelResponse

if TYPE_CHECKING:
    from agentbatch.backends.slot_placement import SlotPlacer
    from agentbatch.core.plan import BatchPlan

RetryListener = Callable[[BaseException], None]


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend can do beyond plain chat completions; the engines adapt to these."""

    native_json_schema: bool = False  # honours response_format json_schema / guided JSON
    prefix_cache_metrics: bool = False  # exposes /metrics with prefix-cache hit rate
    prefix_warming: bool = False  # a warm-up request populates a server-side prefix cache
    # The server computes a prefix its requests in flight share once (vLLM v1 registers a
    # block in its prefix cache when it schedules it), so a burst of first turns needs no
    # warm-up: ``warm`` only checks the server answers (``OpenAICompatBackend.warm``).
    prefix_shared_in_flight: bool = False
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


class Backend(ABC):
    """A model server. ``complete`` raises ``agentbatch.core.errors.BackendError`` subclasses.

    Every hook below has a default meaning "this backend does not do that"; a driver overrides
    the ones it supports, and a wrapper (``BackendWrapper``) forwards each to its inner backend.
    """

    name: str
    capabilities: BackendCapabilities

    @abstractmethod
    async def complete(self, request: ModelRequest) -> ModelResponse:
        """One model turn; called by both engines for every turn."""

    @abstractmethod
    async def aclose(self) -> None:
        """Called once when the batch (or the worker) is done with this backend."""

    # -- hooks: the defaults mean "not supported" -------------------------------------------

    async def preflight(self, plan: BatchPlan) -> None:
        """Called on each endpoint before any agent is dispatched (``setup.preflight_backend``,
        both engines' submit): raise ``ConfigError``/``BatchSpecError`` if this server cannot run
        ``plan``. Default: nothing to check."""
        return None

    async def warm(self, request: ModelRequest) -> None:
        """Called once with the shared prefix before the fan-out when
        ``capabilities.prefix_warming`` (``setup.warm_backend``). Default: nothing to warm."""
        return None

    async def fetch_load(self) -> ServerLoad | None:
        """Called by the backpressure gate and at preflight for ``max_server_waiting``; never
        raises. Default None: this backend publishes no queue, so nothing is ever held."""
        return None

    @property
    def inflight_hint(self) -> int | None:
        """Read when an engine sizes its in-flight cap (``setup.inflight_hint``): the most
        requests worth having in flight. Default None: no opinion (the default cap applies)."""
        return None

    async def learn_inflight_hint(self) -> None:
        """Called on workers, where no preflight ran, while ``inflight_hint`` is None
        (``setup.learn_inflight_hint``). Default: nothing to learn."""
        return None

    async def save_conversation(self, agent_key: str) -> str | None:
        """Called by an endpoint pool as a turn of ``agent_key`` moves off this endpoint for
        load (``pool.EndpointPool``): write the agent's conversation, as this server holds it,
        where the pool's other servers can read it (llama.cpp: a slot file), and return the
        name it was written under, for ``restore_conversation``. The name is the driver's to
        choose: one no other save in flight can take (llama.cpp: this server's slot). None:
        nothing written (not supported, not held here, or refused). Default: not
        supported."""
        return None

    async def restore_conversation(self, agent_key: str, name: str) -> bool:
        """Called by an endpoint pool after another endpoint's ``save_conversation``: load
        ``name`` here, so the agent's moved turn, sent here next, finds its conversation
        cached instead of computing it again. False: not loaded. Default: not supported."""
        return False

    async def pinned_slots(self) -> int | None:
        """Read by a distributed submitter after ``preflight``: the slot count of a server
        whose turns this driver pins to slots (llama.cpp, once its warm-up probe found that
        pinning keeps the prefix), recorded in the plan (``BatchPlan.pinned_slots``) so the
        workers pin alike (``share_slots``). Default None: no pinning."""
        return None

    def share_slots(self, placer: SlotPlacer) -> bool:
        """Called on a distributed worker for an endpoint the plan names in ``pinned_slots``:
        pin turns through ``placer``, the fleet's shared slot map, so every worker sends an
        agent's turn to the slot holding its conversation. False: not taken. Default: not
        supported."""
        return False

    async def complete_batch(
        self,
        prompts: list[str],
        *,
        model: str,
        max_tokens: int | None = None,
        temperature: float | None = None,
        json_schema: dict[str, Any] | None = None,
        request_id: str = "",
        messages: list[list[Message]] | None = None,
    ) -> list[ModelResponse | BackendError]:
        """Called by ``MicroBatchingBackend`` (only when ``capabilities.batch_prompting``): many
        prompts in one request, a result or error per prompt. Default: not supported."""
        raise NotImplementedError(f"{self.name} does not take a list of prompts")

    @property
    def batch_limit(self) -> int | None:
        """Read by ``MicroBatchingBackend`` before each batch: the most prompts worth sending in
        one. Default None: no limit beyond its own ``max_batch``."""
        return None

    async def health(self) -> bool:
        """Called by ``EndpointPool``'s probe to re-admit an ejected endpoint; never raises.
        Default True: nothing to ask, so real traffic decides."""
        return True

    @property
    def listeners(self) -> list[RetryListener]:
        """Called with each error about to be retried; workers append the fleet-wide AIMD here
        (``workers.context``). Default: a fresh list, since a backend that does not retry never
        calls it (appending registers nothing)."""
        return []

    async def context_length(self) -> int | None:
        """Called before each turn (``context_fit.fit_request``, both engines): the model's
        context in tokens as the server states it, learnt once. Default None: unknown, so
        prompts are checked only against ``max_context_tokens``."""
        return None

    async def count_tokens(self, prompt: str | list[Message],
                           tools: list[dict[str, Any]] | None = None) -> int | None:
        """Called by ``context_fit`` when a prompt may not fit: its size in the server's own
        tokens (its ``/tokenize``), chat template included for messages. Default None: the
        server cannot count, so the size is estimated from its characters."""
        return None

    @property
    def requests_sent(self) -> int | None:
        """HTTP requests sent for model calls, read for stats (``embedded_handle.stats``,
        ``MicroBatchingBackend``). Default None: not counted."""
        return None

    @property
    def retries(self) -> int | None:
        """Retries performed, read for stats (``embedded_handle.stats``). Default None: this
        backend does not retry."""
        return None


class BackendWrapper(Backend):
    """Base of the layers that wrap a backend (retries, AIMD, micro-batching, tests).

    Its name and capabilities are the inner backend's, and so is every hook a layer does not
    override: each is forwarded here by name, never by ``__getattr__``.
    """

    def __init__(self, inner: Backend) -> None:
        self._inner = inner
        self.name = inner.name
        self.capabilities = inner.capabilities

    @property
    def inner(self) -> Backend:
        return self._inner

    async def complete(self, request: ModelRequest) -> ModelResponse:
        return await self._inner.complete(request)

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def preflight(self, plan: BatchPlan) -> None:
        await self._inner.preflight(plan)

    async def warm(self, request: ModelRequest) -> None:
        await self._inner.warm(request)

    async def fetch_load(self) -> ServerLoad | None:
        return await self._inner.fetch_load()

    @property
    def inflight_hint(self) -> int | None:
        return self._inner.inflight_hint

    async def learn_inflight_hint(self) -> None:
        await self._inner.learn_inflight_hint()

    async def save_conversation(self, agent_key: str) -> str | None:
        return await self._inner.save_conversation(agent_key)

    async def restore_conversation(self, agent_key: str, name: str) -> bool:
        return await self._inner.restore_conversation(agent_key, name)

    async def pinned_slots(self) -> int | None:
        return await self._inner.pinned_slots()

    def share_slots(self, placer: SlotPlacer) -> bool:
        return self._inner.share_slots(placer)

    async def complete_batch(self, prompts: list[str], **kwargs: Any
                             ) -> list[ModelResponse | BackendError]:
        return await self._inner.complete_batch(prompts, **kwargs)

    @property
    def batch_limit(self) -> int | None:
        return self._inner.batch_limit

    async def health(self) -> bool:
        return await self._inner.health()

    @property
    def listeners(self) -> list[RetryListener]:
        return self._inner.listeners

    async def context_length(self) -> int | None:
        return await self._inner.context_length()

    async def count_tokens(self, prompt: str | list[Message],
                           tools: list[dict[str, Any]] | None = None) -> int | None:
        return await self._inner.count_tokens(prompt, tools)

    @property
    def requests_sent(self) -> int | None:
        return self._inner.requests_sent

    @property
    def retries(self) -> int | None:
        return self._inner.retries
