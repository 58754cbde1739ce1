"""``hedge_after=`` on the distributed engine: real ``agentbatch worker`` processes, a real
redis-server, and a pool of three simulator processes over HTTP, one of them slow.

Each worker process hedges the turns it runs (its own latency windows, its own bar), and
counts every settled hedge on the batch (``stat:hedges`` and who won, in ``status()``:
``distributed/workers/hedging.py``, written within half a second). The race is inside the
pool's ``complete``, so a turn's reply is committed once. Assertions are outcomes and counts
(results, transcripts, the batch's counters, ``/sim/stats``), never timings.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from agentbatch import submit_batch
from agentbatch.sim.process import SimProcess
from tests.integration.test_pool_hedge import stats, unanswered, wait_until
from tests.support.sim_pool import slow_pool
from tests.support.tools import Answer, lookup

pytestmark = [pytest.mark.redis, pytest.mark.slow]

# ~2/3 homed on the two fast servers: each worker process gets 20 answers from one of them
# (its bar) long before the batch ends, whichever of the two workers takes which turn
AGENTS = 60
TOOL_CALLS = 2  # three model turns per agent
TASK = "Agent {i}.\n" + "\n".join(f'@sim tool lookup {{{{"key": "k{n}-{{i}}"}}}}'
                                  for n in range(TOOL_CALLS))
WAIT_S = 300.0


@pytest.fixture
def pool() -> Iterator[tuple[list[SimProcess], SimProcess]]:
    """Three simulator processes: two fast, one slow (the last)."""
    with slow_pool() as procs:
        yield procs


def _chat_requests(sims: list[SimProcess]) -> int:
    return sum(int(stats(s)["requests"].get("chat_completions", 0)) for s in sims)


def test_workers_hedge_slow_turns_count_them_on_the_batch_and_apply_each_turn_once(
        pool: tuple[list[SimProcess], SimProcess], redis_url: str, start_workers) -> None:
    sims, slow = pool
    start_workers(2, concurrency=8)
    urls = [s.url for s in sims]
    handle = submit_batch(TASK, [{"i": i} for i in range(AGENTS)], model="sim-model",
                          output_schema=Answer, tools=[lookup], backend=urls,
                          hedge_after=2.0, keep_transcript=True, timeout_per_turn=60,
                          warm_prefix=False, redis_url=redis_url)
    results = handle.wait(timeout=WAIT_S)

    def settled() -> bool:  # a worker writes its hedge counts in the background (batch_stats)
        c = handle.status()
        return c.get("stat:hedges", 0) >= 1 and c["stat:hedges"] == sum(
            c.get(f"stat:{o}", 0)
            for o in ("hedge_wins", "hedge_original_wins", "hedge_both_failed"))

    wait_until(settled, "the workers' hedge counts on the batch")
    counts = handle.status()

    # Every agent finished, each turn applied once: three model turns, two tool results, no
    # assistant message twice from a hedged pair.
    assert len(results) == AGENTS
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    for r in results:
        roles = [m["role"] for m in r.messages or []]
        assert r.turns == TOOL_CALLS + 1, (r.index, r.turns)
        assert roles.count("assistant") == TOOL_CALLS + 1, (r.index, roles)
        assert roles.count("tool") == TOOL_CALLS, (r.index, roles)

    # The workers hedged, counted each settled hedge on the batch, and the hedges won.
    hedges = counts.get("stat:hedges", 0)
    assert hedges >= 1, counts
    assert hedges == (counts.get("stat:hedge_wins", 0)
                      + counts.get("stat:hedge_original_wins", 0)
                      + counts.get("stat:hedge_both_failed", 0)), counts
    assert counts.get("stat:hedge_wins", 0) >= 1 and "stat:hedge_both_failed" not in counts

    # The losers on the slow server were cancelled (closed before it answered), and no
    # request was left unanswered but a hedged pair's loser.
    wait_until(lambda: stats(slow)["running"] == 0, "the slow server to hold no request")
    assert unanswered(slow) >= 1
    assert sum(unanswered(s) for s in sims) <= hedges

    # The same pool without hedge_after, on the same workers: a pool of its own, not hedged
    # (the workers' bars are known by now), so every slow request is answered.
    slow_before, requests_before = unanswered(slow), _chat_requests(sims)
    plain = submit_batch("Agent {i}.", [{"i": i} for i in range(6)], model="sim-model",
                         backend=urls, timeout_per_turn=60, warm_prefix=False,
                         redis_url=redis_url)
    again = plain.wait(timeout=WAIT_S)
    assert all(r.ok and r.turns == 1 for r in again), [r.error for r in again]
    assert "stat:hedges" not in plain.status()
    wait_until(lambda: stats(slow)["running"] == 0, "the slow server to hold no request")
    assert unanswered(slow) == slow_before
    assert _chat_requests(sims) - requests_before == len(again)  # one request per turn
