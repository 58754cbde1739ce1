"""A turn whose provider batch fails or expires when the deadline no longer leaves time for
the sync API ends with a clear error, never silently (issue 27: "Otherwise they end with a
clear error"). Distributed engine: real redis-server, a real ``agentbatch worker`` process,
the simulator's batch API over real HTTP.

How the branch is reached: the hedge would otherwise answer first (every turn's hedge time
has come at once with a deadline this close). So the simulator fails every sync request
(``http_500``) -- a hedge that goes fails at once and the turn waits on its provider batch
(``hedge_failed``), and a turn past the hedge cap waits there anyway -- and the provider batch
fails (every item) or expires 3 s after it was created, when the 3.4 s deadline has less
than the router's margin left (``Router.safety``: 0.5 s at least once the failed hedges'
latencies are seen, the 2 s prior before): past it, whatever the machine's load (a later
failure only leaves less). ``max_retries=0``: the first such error ends the agent."""

from __future__ import annotations

import pytest

from agentbatch import submit_batch
from agentbatch.sim import SimServer
from agentbatch.sim.config import SimConfig
from tests.support.provider_batch import MODEL, PRICES
from tests.support.provider_batch import jobs as _jobs
from tests.support.provider_batch import sim_url as _url
from tests.support.tools import Answer, lookup

TASK = 'Agent {i}.\n@sim tool lookup {{"key": "k{i}"}}'
N = 4
WAIT_S = 180.0
ENDS = {  # how the provider batch ends: 3 s after creation, the deadline 3.4 s after submit
    "failed": {"batch_latency_s": 3.0, "batch_failure_rate": 1.0},
    "expired": {"batch_latency_s": 600.0, "batch_expire_s": 3.0},
}


@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.parametrize("end", sorted(ENDS))
def test_a_provider_batch_that_ends_unanswered_past_the_deadline_ends_its_turns_with_an_error(
        redis_url, start_workers, end) -> None:
    config = SimConfig(fixed_ms=5, batch_latency_spread=0.0,
                       fault_rates={"http_500": 1.0}, **ENDS[end])
    with SimServer(config) as sim:
        start_workers(1, concurrency=8)
        handle = submit_batch(TASK, [{"i": i} for i in range(N)], model=MODEL,
                              backend=_url(sim), tools=[lookup], output_schema=Answer,
                              prices=PRICES, warm_prefix=False, max_turns=3, max_retries=0,
                              redis_url=redis_url, pricing="batch", deadline=3.4)
        results = handle.wait(timeout=WAIT_S)
        stats = handle.status()
        assert len(results) == N
        for r in results:  # each agent ended, with an error that says why
            assert not r.ok and r.error is not None, r
            assert "provider batch turn" in r.error.message, r.error
            assert "the deadline left no time for the sync API" in r.error.message, r.error
            assert r.error.kind == "server_error", r.error
            assert r.turns == 0
        assert "stat:provider_batch_fallback_sync" not in stats  # no sync fallback was paid
        assert stats.get("stat:provider_batch_items", 0) == N
        assert len(_jobs(sim)) == stats.get("stat:provider_batches", 0) >= 1
