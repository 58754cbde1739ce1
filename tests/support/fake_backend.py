"""One scripted fake backend for unit tests of the layers above a backend (retries, AIMD,
micro-batching, pools, backpressure): no HTTP, every call recorded.

Each ``complete`` takes the next outcome of its script: an exception is raised, a
``ModelResponse`` returned, a string answered as text; with the script used up (or on
``None``) it answers ``reply``. A test that needs another rule overrides ``outcome``.
"""

from __future__ import annotations

import asyncio

from agentbatch.backends.base import Backend, BackendCapabilities, ServerLoad
from agentbatch.core.model_io import ModelRequest, ModelResponse

Outcome = BaseException | ModelResponse | str | None


class ScriptedBackend(Backend):
    """Answers from a script; counts calls and concurrency; every hook is a plain attribute."""

    def __init__(self, *script: Outcome, name: str = "scripted",
                 capabilities: BackendCapabilities | None = None, reply: str = "ok",
                 hold: asyncio.Event | None = None, load: ServerLoad | None = None,
                 inflight_hint: int | None = None) -> None:
        self.name = name
        self.capabilities = capabilities or BackendCapabilities()
        self.script: list[Outcome] = list(script)
        self.reply = reply
        self.hold = hold  # when set, each call waits for the event before answering
        self.load = load  # what ``fetch_load`` returns
        self.healthy = True  # what ``health`` returns
        self._inflight_hint = inflight_hint
        self.requests: list[ModelRequest] = []
        self.warmed: list[ModelRequest] = []
        self.calls = 0
        self.active = 0
        self.peak = 0
        self.closed = False

    def outcome(self, request: ModelRequest) -> Outcome:
        """The outcome of this call: the script's next one, else None (answer ``reply``)."""
        return self.script.pop(0) if self.script else None

    async def complete(self, request: ModelRequest) -> ModelResponse:
        self.calls += 1
        self.requests.append(request)
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            if self.hold is not None:
                await self.hold.wait()
            outcome = self.outcome(request)
        finally:
            self.active -= 1
        if isinstance(outcome, BaseException):
            raise outcome
        if isinstance(outcome, ModelResponse):
            return outcome
        return ModelResponse(text=self.reply if outcome is None else outcome)

    async def warm(self, request: ModelRequest) -> None:
        self.warmed.append(request)

    async def fetch_load(self) -> ServerLoad | None:
        return self.load

    async def health(self) -> bool:
        return self.healthy

    @property
    def inflight_hint(self) -> int | None:
        return self._inflight_hint

    async def aclose(self) -> None:
        self.closed = True
