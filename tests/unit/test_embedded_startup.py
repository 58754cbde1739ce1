"""Before the fan-out the embedded engine warms the shared prefix and asks the server's
context length (``handle._warm_and_learn_context``). Neither needs the other's answer, so
they are in flight together: the context ask adds no round trip to the critical path of a
batch's first turns (issue 26 item 5). A failed warm-up still fails the start, as itself."""

from __future__ import annotations

import asyncio

import pytest

from agentbatch.backends.base import BackendCapabilities
from agentbatch.core.errors import BackendUnavailable
from agentbatch.core.model_io import ModelRequest
from agentbatch.core.options import BatchOptions
from agentbatch.core.wait_for import wait_for
from agentbatch.embedded.handle import _warm_and_learn_context
from agentbatch.turnloop.compile import compile_batch
from tests.support.fake_backend import ScriptedBackend


class Starting(ScriptedBackend):
    """The context ask answers only once the warm-up is in flight, and the warm-up only once
    the context has been asked: asked one after the other, the first waits in vain."""

    def __init__(self, *, warm_fails: bool = False) -> None:
        super().__init__(capabilities=BackendCapabilities(prefix_warming=True))
        self.asked, self.warming = asyncio.Event(), asyncio.Event()
        self.overlapped = self.ask_cancelled = False
        self.warm_fails = warm_fails

    async def context_length(self) -> int | None:
        self.asked.set()
        try:
            await wait_for(self.warming.wait(), 2)  # (asyncio's can lose a cancel before 3.12)
            self.overlapped = True
            if self.warm_fails:
                await asyncio.sleep(30)  # still asking when the warm-up fails
        except asyncio.CancelledError:
            self.ask_cancelled = True
            raise
        return 4096

    async def warm(self, request: ModelRequest) -> None:
        await super().warm(request)
        self.warming.set()
        await wait_for(self.asked.wait(), 2)
        if self.warm_fails:
            raise BackendUnavailable("connection refused")


def _plan():  # type: ignore[no-untyped-def]
    return compile_batch(BatchOptions(task="t {x}", inputs=[{"x": 1}, {"x": 2}], model="m",
                                      backend="sim://127.0.0.1:8000")).plan


async def test_the_warm_up_and_the_context_ask_are_in_flight_together() -> None:
    backend = Starting()
    await asyncio.wait_for(_warm_and_learn_context(backend, _plan()), 10)
    assert len(backend.warmed) == 1 and backend.overlapped


async def test_a_failed_warm_up_fails_as_itself_and_the_ask_is_cancelled() -> None:
    backend = Starting(warm_fails=True)
    with pytest.raises(BackendUnavailable, match="failed the warm-up"):
        await asyncio.wait_for(_warm_and_learn_context(backend, _plan()), 10)
    for _ in range(100):  # a few loop turns for the cancellation to land
        if backend.ask_cancelled:
            break
        await asyncio.sleep(0)
    assert backend.ask_cancelled
