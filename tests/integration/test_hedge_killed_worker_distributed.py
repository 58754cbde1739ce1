"""A provider-batch turn hedged to the sync API, whose worker is SIGKILLed while that sync
request is in flight, on the distributed engine: the provider bills the request, and nothing
the dead worker wrote says what it cost. The batch must say it happened (a request paid,
its tokens unknown: ``stat:hedge_sync_paid_unknown``), and every agent still ends with a
result.

The simulator serves the OpenAI batch API over real HTTP. Every agent's first turn goes into
one provider batch that never ends (agent 0's item is ``@simbatch hold``), so every turn is
hedged to the sync API at the deadline's hedge time. Agent 0's first sync request is held by
the simulator (``@sim fail timeout``, a hold far longer than the test): the worker is killed
while it waits on it. A second worker's sweep re-sends agent 0's turn, which waits on the
same provider batch, hedges again, and its second sync request is answered. Real
redis-server, real ``agentbatch worker`` processes. Counts only, never timings.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from agentbatch import submit_batch
from agentbatch.sim import SimServer
from agentbatch.sim.config import SimConfig
from tests.support.provider_batch import MODEL, PRICES, sim_url
from tests.support.tools import Answer
from tests.support.waits import poll_until

pytestmark = [pytest.mark.redis, pytest.mark.slow]

TASK = "Agent {i}.{hold}"
HOLD = "\n@simbatch hold\n@sim fail timeout times=1"
N = 6
DEADLINE_S = 40.0  # the hedge time comes seconds after the submit (as in the lost-bill test)
WAIT_S = 180.0


@pytest.fixture
def sim() -> Iterator[SimServer]:
    # a held sync request is answered only long after the test is over
    with SimServer(SimConfig(fixed_ms=5, batch_latency_s=0.3, batch_latency_spread=0.0,
                             timeout_hold_s=900.0)) as server:
        yield server


def submit(sim: SimServer, redis_url: str):
    inputs = [{"i": i, "hold": HOLD if i == 0 else ""} for i in range(N)]
    return submit_batch(TASK, inputs, model=MODEL, backend=sim_url(sim),
                        output_schema=Answer, prices=PRICES, warm_prefix=False, max_turns=2,
                        pricing="batch", deadline=DEADLINE_S, redis_url=redis_url)


def sync_requests(sim: SimServer) -> int:
    """Sync chat requests the simulator received (a held one included)."""
    return int(sim.state.stats.requests["chat_completions"])


def test_a_worker_killed_during_its_sync_hedge_leaves_the_paid_request_counted(
        sim: SimServer, redis_url: str, start_workers) -> None:
    [first] = start_workers(1, concurrency=8)
    handle = submit(sim, redis_url)

    def read() -> tuple[dict[str, int], int]:
        return handle.status(), sync_requests(sim)

    def held(seen: tuple[dict[str, int], int]) -> bool:
        counts, received = seen
        # the other agents' hedges won; agent 0's sync request reached the simulator
        return counts.get("stat:hedge_won_by_sync", 0) == N - 1 and received == N

    poll_until(read, held, lambda seen: f"no held hedge yet: {seen}", timeout=90)
    first.kill()  # SIGKILL: agent 0's sync hedge request is in flight, billed by the provider
    [second] = start_workers(1, concurrency=8)  # its sweep re-sends agent 0's turn

    results = handle.wait(timeout=WAIT_S)
    assert len(results) == N and all(r.ok for r in results), \
        [r.error for r in results if not r.ok][:3]
    counts = handle.status()
    assert sync_requests(sim) == N + 1  # agent 0's turn went to the sync API twice
    # the request the dead worker paid for is on the batch, its tokens unknown
    assert counts.get("stat:hedge_sync_paid_unknown", 0) == 1, counts
    # every hedge sent is accounted for: won by sync (committed), or paid and unknown
    assert counts["stat:batch_hedged"] == (
        counts["stat:hedge_won_by_sync"] + counts.get("stat:hedge_won_by_batch", 0)
        + counts.get("stat:hedge_failed", 0) + counts["stat:hedge_sync_paid_unknown"]), counts
    assert counts["stat:hedge_won_by_sync"] == N
    assert counts["stat:recovered"] >= 1  # agent 0's turn was re-sent by the sweep
    # and said, naming the batch and the agent
    logged = second.log_path.read_text(errors="replace")
    assert f"batch {handle.batch_id}: agent 0 v" in logged, logged[-2000:]
    assert "stat:hedge_sync_paid_unknown" in logged



FALLBACK = "\n@simbatch fail\n@sim fail timeout times=1"


def test_a_worker_killed_during_its_sync_fallback_leaves_the_paid_request_counted(
        sim: SimServer, redis_url: str, start_workers) -> None:
    """The same for a turn whose provider batch item failed and went to the sync API
    (``provider_batch_fallback_sync``): that request is billed too."""
    [first] = start_workers(1, concurrency=8)
    inputs = [{"i": i, "hold": FALLBACK if i == 0 else ""} for i in range(N)]
    handle = submit_batch(TASK, inputs, model=MODEL, backend=sim_url(sim),
                          output_schema=Answer, prices=PRICES, warm_prefix=False, max_turns=2,
                          pricing="batch", deadline=DEADLINE_S, redis_url=redis_url)

    def read() -> tuple[dict[str, int], int]:
        return handle.status(), sync_requests(sim)

    def held(seen: tuple[dict[str, int], int]) -> bool:
        counts, received = seen  # agent 0's fallback request reached the simulator
        return counts.get("stat:provider_batch_fallback_sync", 0) == 1 and received == 1

    poll_until(read, held, lambda seen: f"no held fallback yet: {seen}", timeout=90)
    first.kill()  # SIGKILL with agent 0's sync request in flight
    [second] = start_workers(1, concurrency=8)

    results = handle.wait(timeout=WAIT_S)
    assert len(results) == N and all(r.ok for r in results), \
        [r.error for r in results if not r.ok][:3]
    counts = handle.status()
    assert sync_requests(sim) == 2  # agent 0's turn went to the sync API twice
    assert counts.get("stat:hedge_sync_paid_unknown", 0) == 1, counts
    assert counts["stat:recovered"] >= 1
    logged = second.log_path.read_text(errors="replace")
    assert f"batch {handle.batch_id}: agent 0 v" in logged, logged[-2000:]
