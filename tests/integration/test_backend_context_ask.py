"""The context length is asked once, and every agent's first turn gets the answer at once.

Every agent's first turn asks the backend for its context (``context_fit``). They used to
queue on a lock that woke one waiter per event-loop pass, which spread a 200-agent batch's
first requests over a second of loop passes (issue 26 item 5). Real HTTP against the
simulator; the loop passes are counted by a task that yields once per pass.
"""

from __future__ import annotations

import asyncio

from agentbatch.backends.openai_compat import OpenAICompatBackend
from agentbatch.sim.server import SimServer


class _Counting(OpenAICompatBackend):
    """The real backend, counting how often it asks the server (``GET /v1/models``)."""

    asked = 0

    async def _learn_context(self) -> tuple[bool, int | None]:
        self.asked += 1
        return await super()._learn_context()


async def _passes(counter: list[int]) -> None:
    while True:
        counter[0] += 1
        await asyncio.sleep(0)


async def test_concurrent_first_turns_share_one_ask_and_wake_together(sim: SimServer) -> None:
    backend = _Counting("sim://" + sim.url.split("://", 1)[1])
    passes = [0]
    ticker = asyncio.create_task(_passes(passes))
    answers: list[tuple[int, int | None]] = []

    async def first_turn() -> None:
        context = await backend.context_length()
        answers.append((passes[0], context))

    try:
        await asyncio.gather(*(first_turn() for _ in range(100)))
    finally:
        ticker.cancel()
        await backend.aclose()
    assert backend.asked == 1
    assert {c for _, c in answers} == {sim.state.config.max_model_len}
    woken = [p for p, _ in answers]
    assert max(woken) - min(woken) <= 1, f"woken over {max(woken) - min(woken)} loop passes"
    assert await backend.context_length() == sim.state.config.max_model_len
    assert backend.asked == 1  # learnt: never asked again


async def test_a_cancelled_first_turn_does_not_cancel_the_ask_for_the_others(
        sim: SimServer) -> None:
    backend = _Counting("sim://" + sim.url.split("://", 1)[1])
    try:
        turns = [asyncio.create_task(backend.context_length()) for _ in range(10)]
        await asyncio.sleep(0)
        await asyncio.sleep(0)  # the first turn's ask is on its way
        turns[0].cancel()
        results = await asyncio.gather(*turns, return_exceptions=True)
    finally:
        await backend.aclose()
    assert isinstance(results[0], asyncio.CancelledError)
    assert results[1:] == [sim.state.config.max_model_len] * 9
    assert backend.asked == 1


async def test_a_server_that_does_not_answer_is_asked_again() -> None:
    with SimServer() as down:
        url = "sim://" + down.url.split("://", 1)[1]
    backend = _Counting(url)  # nothing listens there any more
    try:
        assert await asyncio.gather(*(backend.context_length() for _ in range(5))) == [None] * 5
        assert backend.asked == 1
        assert await backend.context_length() is None
        assert backend.asked == 2
    finally:
        await backend.aclose()
