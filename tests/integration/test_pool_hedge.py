"""``hedge_after=``: a pool of three simulator processes, one of them slow, over real HTTP.

The slow server answers each request after seconds, the other two at once. Once the fast
endpoints have answered enough turns for a p95, every turn in flight on the slow one past
``hedge_after`` x that p95 goes again to a fast endpoint, which answers first; the slow
request is cancelled. Assertions are outcomes and counts (results, transcripts, the pool's
hedge counters, ``/sim/stats``), never timings.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agentbatch import run_batch, submit_batch, tool
from agentbatch.backends.hedge import Attempt, Hedger
from agentbatch.core.errors import BackendUnavailable, BatchSpecError
from agentbatch.core.model_io import ModelResponse, Usage
from agentbatch.sim.process import SimProcess
from tests.support.sim_pool import slow_pool
from tests.support.tools import Answer

AGENTS = 45  # ~30 homed on the fast servers: an endpoint reaches 20 answers (the p95)
TOOL_CALLS = 2  # so each agent takes three model turns


@tool
def echo(text: str) -> str:
    """Say ``text`` back.

    Args:
        text: what to say.
    """
    return text


TASK = "Agent {i}.\n" + "\n".join(f'@sim tool echo {{{{"text": "t{n}"}}}}'
                                  for n in range(TOOL_CALLS))


def stats(sim: SimProcess) -> dict[str, Any]:
    with urllib.request.urlopen(sim.url + "/sim/stats", timeout=30) as resp:
        return dict(json.loads(resp.read()))


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def pool() -> Iterator[tuple[list[SimProcess], SimProcess]]:
    """Three simulators: two fast, one slow (the last)."""
    with slow_pool() as procs:
        yield procs


def unanswered(sim: SimProcess) -> int:
    """Chat requests the server took and never answered: the client went away first."""
    s = stats(sim)
    return int(s["requests"].get("chat_completions", 0)) - int(s["success"])


def test_slow_endpoint_turns_are_hedged_answered_elsewhere_applied_once_loser_cancelled(
        pool: tuple[list[SimProcess], SimProcess]) -> None:
    sims, slow = pool
    handle = submit_batch(TASK, [{"i": i} for i in range(AGENTS)], model="sim-model",
                          output_schema=Answer, tools=[echo], backend=[s.url for s in sims],
                          hedge_after=2.0, keep_transcript=True, timeout_per_turn=60)
    results = handle.wait(timeout=300)
    hedge = handle.stats()["pool"]["hedge"]

    # Every agent finished, and each of its turns was applied once: three model turns, two
    # tool results, no duplicated assistant message from a hedged pair.
    assert len(results) == AGENTS
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    for r in results:
        roles = [m["role"] for m in r.messages or []]
        assert r.turns == TOOL_CALLS + 1, (r.index, r.turns)
        assert roles.count("assistant") == TOOL_CALLS + 1, roles
        assert roles.count("tool") == TOOL_CALLS, roles

    # Turns were hedged, the hedges answered first, and every hedge was settled.
    assert hedge["hedge_after"] == 2.0 and hedge["min_samples"] == 20
    assert hedge["hedges"] >= 1 and hedge["hedge_wins"] >= 1, hedge
    assert hedge["hedges"] == (hedge["hedge_wins"] + hedge["original_wins"]
                               + hedge["both_failed"]), hedge
    assert hedge["both_failed"] == 0
    assert hedge["loser_prompt_tokens"] > 0  # the duplicate prompts, counted

    # The losers on the slow server were really cancelled: once it has nothing running, it
    # has requests it never answered (the client closed them); a loser left to run would
    # have been answered after SLOW_MS (tests/support/sim_pool.py). Nothing else disconnects
    # in this batch.
    wait_until(lambda: stats(slow)["running"] == 0, "the slow server to hold no request")
    assert unanswered(slow) >= 1
    assert sum(unanswered(s) for s in sims) <= hedge["hedges"]
    # The slow server's agents were answered by the fast ones (their hedges).
    fast_agents = set().union(*(stats(s)["chat_by_agent"] for s in sims[:2]))
    slow_agents = set(stats(slow)["chat_by_agent"])
    assert slow_agents <= fast_agents


def test_without_hedge_after_nothing_is_hedged(
        pool: tuple[list[SimProcess], SimProcess]) -> None:
    sims, slow = pool
    handle = submit_batch(TASK, [{"i": i} for i in range(6)], model="sim-model",
                          output_schema=Answer, tools=[echo], backend=[s.url for s in sims],
                          timeout_per_turn=60)
    results = handle.wait(timeout=300)
    assert all(r.ok and r.turns == TOOL_CALLS + 1 for r in results)
    assert handle.stats()["pool"]["hedge"] is None
    wait_until(lambda: stats(slow)["running"] == 0, "the slow server to hold no request")
    assert unanswered(slow) == 0


# --- bad input: refused at submit, naming hedge_after, before anything is sent -----------

POOL = ["http://127.0.0.1:9", "http://127.0.0.1:10", "http://127.0.0.1:11"]  # never contacted


@pytest.mark.parametrize("value", [1, 1.0, 0.5, 0, -2, float("nan"), float("inf"), True, "2"])
def test_hedge_after_must_be_a_finite_number_above_one(value: Any) -> None:
    with pytest.raises(BatchSpecError, match=r"hedge_after must be a finite number > 1"):
        run_batch("t {x}", [{"x": 1}], model="m", backend=POOL, hedge_after=value)


def test_hedge_after_needs_a_pool_of_two_or_more(tmp_path: Path) -> None:
    with pytest.raises(BatchSpecError, match=r"hedge_after cannot apply to backend "
                                             r"'http://127\.0\.0\.1:9'.*>= 2 endpoints"):
        run_batch("t {x}", [{"x": 1}], model="m", backend=POOL[0], hedge_after=2)
    with pytest.raises(BatchSpecError, match=r"hedge_after cannot apply to backend"):
        run_batch("t {x}", [{"x": 1}], model="m", backend=[POOL[0]], hedge_after=2)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.1:9\n")  # a hostfile of one endpoint is not a pool
    with pytest.raises(BatchSpecError, match=r"hedge_after cannot apply to backend"):
        run_batch("t {x}", [{"x": 1}], model="m", backend=[f"@{hostfile}"], hedge_after=2)


def test_hedge_after_has_no_sync_turns_to_hedge_with_pricing_batch() -> None:
    with pytest.raises(BatchSpecError, match=r'hedge_after cannot apply with pricing="batch"'):
        run_batch("t {x}", [{"x": 1}], model="m", backend=POOL, hedge_after=2,
                  pricing="batch")


# --- the race's rules, on the Hedger alone (edge cases a healthy pool does not reach) ------


def _primed(hedge_after: float = 2.0) -> Hedger:
    hedger = Hedger(hedge_after, min_samples=3)
    for _ in range(3):
        hedger.record("fast", 0.001)  # bar: 2 ms
    return hedger


def _reply(text: str, prompt_tokens: int = 7) -> ModelResponse:
    return ModelResponse(text=text, usage=Usage(prompt_tokens=prompt_tokens,
                                                completion_tokens=1))


def test_an_answer_before_the_bar_sends_no_hedge() -> None:
    async def main() -> None:
        hedger = Hedger(2.0, min_samples=3)  # no bar yet: nothing is hedged
        reply = await hedger.race(Attempt("a", lambda: _answer_after(0.0, "a")),
                                  lambda bar: pytest.fail("hedged without a bar"))
        assert reply.text == "a" and hedger.hedges == 0
    asyncio.run(main())


def test_both_failing_raises_the_originals_error_and_counts_it() -> None:
    async def main() -> None:
        hedger = _primed()
        gate = asyncio.Event()

        async def original() -> ModelResponse:
            await gate.wait()
            raise BackendUnavailable("original down")

        async def second() -> ModelResponse:
            gate.set()  # the original fails once the hedge is in flight
            raise BackendUnavailable("hedge down")

        with pytest.raises(BackendUnavailable, match="original down"):
            await hedger.race(Attempt("slow", original), lambda bar: Attempt("fast", second))
        assert hedger.hedges == 1 and hedger.both_failed == 1 and hedger.hedge_wins == 0
    asyncio.run(main())


def test_a_failed_hedge_leaves_the_original_to_answer() -> None:
    async def main() -> None:
        hedger = _primed()
        gate = asyncio.Event()

        async def original() -> ModelResponse:
            await gate.wait()
            return _reply("original")

        async def second() -> ModelResponse:
            gate.set()
            raise BackendUnavailable("hedge down")

        reply = await hedger.race(Attempt("slow", original), lambda bar: Attempt("fast", second))
        assert reply.text == "original" and hedger.original_wins == 1
    asyncio.run(main())


def test_no_endpoint_to_hedge_to_waits_for_the_original() -> None:
    async def main() -> None:
        hedger = _primed()
        reply = await hedger.race(Attempt("slow", lambda: _answer_after(0.05, "original")),
                                  lambda bar: None)
        assert reply.text == "original" and hedger.no_target == 1 and hedger.hedges == 0
    asyncio.run(main())


def test_the_loser_is_cancelled_and_its_prompt_counted() -> None:
    async def main() -> None:
        hedger = _primed()
        cancelled = asyncio.Event()

        async def original() -> ModelResponse:
            try:
                await asyncio.Event().wait()  # never answers
            except asyncio.CancelledError:
                cancelled.set()
                raise
            raise AssertionError("unreachable")

        reply = await hedger.race(Attempt("slow", original),
                                  lambda bar: Attempt("fast", lambda: _answer_after(0, "hedge")))
        assert reply.text == "hedge" and cancelled.is_set()
        assert hedger.hedge_wins == 1 and hedger.loser_prompt_tokens == 7
    asyncio.run(main())


async def _answer_after(seconds: float, text: str) -> ModelResponse:
    await asyncio.sleep(seconds)
    return _reply(text)
