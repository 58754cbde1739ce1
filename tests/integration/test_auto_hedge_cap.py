"""The hedge cap on the distributed engine (``batch_routing.Router.hedge_cap``): turns whose
hedge time comes together race the sync API only as far as the sync path can answer before
the deadline; the rest keep waiting in their provider batch, counted ``hedge_capped``. Real
redis-server, a real ``agentbatch worker`` process, the simulator's batch API over real HTTP.
Asserts what agentbatch decided (the batch's stats), never timings."""

from __future__ import annotations

import pytest

from agentbatch import submit_batch
from agentbatch.sim import SimServer
from agentbatch.sim.config import SimConfig
from tests.support.provider_batch import MODEL, PRICES, chat_requests
from tests.support.provider_batch import sim_url as _url
from tests.support.tools import Answer, lookup

TASK = 'Agent {i}.\n@sim tool lookup {{"key": "k{i}"}}'  # two turns: a tool call, the answer
N = 6
WAIT_S = 180.0


@pytest.mark.redis
@pytest.mark.slow
def test_turns_due_together_beyond_the_sync_paths_capacity_keep_waiting_in_their_batch(
        redis_url, start_workers) -> None:
    # The worker has seen no sync turn yet: its prior is 5 s a turn, one at a time (0.2 a
    # second), so with 9 s to the deadline the sync path can take one hedge (1.3 turns).
    # All six first turns are due at once (six behind each other would not fit), and each
    # sync turn takes 4 s, so the first hedge is still out while the others ask.
    with SimServer(SimConfig(fixed_ms=4000, batch_latency_s=5.0,
                             batch_latency_spread=0.0)) as sim:
        start_workers(1, concurrency=8)
        handle = submit_batch(TASK, [{"i": i} for i in range(N)], model=MODEL,
                              backend=_url(sim), tools=[lookup], output_schema=Answer,
                              prices=PRICES, warm_prefix=False, max_turns=3,
                              redis_url=redis_url, pricing="batch", deadline=9.0)
        results = handle.wait(timeout=WAIT_S)
        assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
        assert [r.turns for r in results] == [2] * N  # each turn applied exactly once
        stats = handle.status()
        assert stats.get("stat:hedge_capped", 0) >= 1, stats
        # without the cap every one of the 2N turns was hedged (the hedge time of each had
        # come at once); with it, some were answered by their provider batch alone
        hedged = stats.get("stat:batch_hedged", 0)
        assert hedged < 2 * N, stats
        assert stats.get("stat:hedge_won_by_sync", 0) + stats.get("stat:hedge_won_by_batch", 0) \
            + stats.get("stat:hedge_failed", 0) == hedged
        assert chat_requests(sim) <= hedged + stats.get("stat:provider_batch_fallback_sync", 0)
