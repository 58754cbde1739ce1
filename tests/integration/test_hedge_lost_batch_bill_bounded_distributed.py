"""A provider batch that nobody waits on any more, polled by a worker only for the bill of the
turns whose sync hedge won, is polled for a stated time at most (until the later of the
batch's deadline and ``CLOSE_BILL_S`` after nobody waited on it), not until the provider's
24 h expiry: the worker then stops, warns, and counts the turns whose bill is not known
(``stat:hedge_lost_batch_unknown``), so it is never silent (distributed engine).

The scenario of ``test_hedge_lost_batch_paid_distributed.py`` (agent 0's request held, so the
provider batch cannot end on its own; every turn hedged, the sync API wins, the worker cancels
the provider batch), with the simulator's cancel stuck: the batch stays ``cancelling`` for an
hour, as a real provider's cancel can for minutes or longer. The simulator runs in this
process, so its cancel handler is swapped for one that takes effect an hour late, and its
batch GET handler counts the worker's polls. Real worker process, real redis-server, real
HTTP. Counts only, no timings: the wait for the count has a deadline well past the bound.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator

import pytest
from aiohttp import web

from agentbatch.sim import SimServer, batch_api
from agentbatch.sim.config import SimConfig
from agentbatch.turnloop.batch_turns import CLOSE_BILL_S, MAX_POLL_S
from tests.integration.test_hedge_lost_batch_paid import DEADLINE_S, WAIT_S, N, submit
from tests.support.batch_bill import sim_stats
from tests.support.provider_batch import MODEL

pytestmark = [pytest.mark.redis, pytest.mark.slow]

STUCK_S = 3600.0  # a cancel takes effect this long after it was asked for


class StuckCancels:
    """The simulator's OpenAI batch cancel, taking effect ``STUCK_S`` late (the batch is
    ``cancelling`` meanwhile), and a count of the polls of each batch."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []
        self.polls: Counter[str] = Counter()

    async def cancel(self, request: web.Request) -> web.Response:
        api = request.app[batch_api.BATCH_API]
        job = api.jobs.get(request.match_info["id"])
        if job is None:
            return web.json_response({"error": {"message": "no such batch"}}, status=404)
        self.cancelled.append(job.id)
        if job.cancelled is None and job.ended_at(time.monotonic()) is None:
            job.cancelled = time.monotonic() + STUCK_S
        return web.json_response(batch_api._openai_batch(api, job))

    async def get(self, request: web.Request) -> web.Response:
        self.polls[request.match_info["id"]] += 1
        return await ORIGINAL_GET(request)


ORIGINAL_GET = batch_api.get_batch


@pytest.fixture
def stuck(monkeypatch: pytest.MonkeyPatch) -> StuckCancels:
    stuck = StuckCancels()
    # ``batch_api.install`` looks the handlers up when the server starts (below)
    monkeypatch.setattr(batch_api, "cancel_batch", stuck.cancel)
    monkeypatch.setattr(batch_api, "get_batch", stuck.get)
    return stuck


@pytest.fixture
def sim(stuck: StuckCancels) -> Iterator[SimServer]:
    with SimServer(SimConfig(fixed_ms=5, batch_latency_s=0.3,
                             batch_latency_spread=0.0)) as server:
        yield server


def test_a_batch_polled_only_for_its_bill_is_given_up_after_a_bound_and_counted(
        sim: SimServer, stuck: StuckCancels, redis_url: str, start_workers) -> None:
    (worker,) = start_workers(1, concurrency=8)
    handle = submit(sim, redis_url=redis_url)
    results = handle.wait(timeout=WAIT_S)
    assert len(results) == N and all(r.ok for r in results), \
        [r.error for r in results if not r.ok][:3]
    counts = handle.status()
    assert counts["stat:hedge_won_by_sync"] == N, counts
    # the worker cancelled the provider batch (its turns all answered by the sync API), and
    # the cancel is stuck: the batch is polled on for its bill
    stop = time.monotonic() + 60
    while not stuck.cancelled:
        assert time.monotonic() < stop, f"no provider batch was cancelled: {counts}"
        time.sleep(0.2)
    (pb,) = set(stuck.cancelled)

    # past the bound (here the deadline) by a wide margin, the worker has
    # given the batch up and said how many turns' bills are unknown
    stop = time.monotonic() + DEADLINE_S + CLOSE_BILL_S + 60
    while True:
        counts = handle.status()
        if "stat:hedge_lost_batch_unknown" in counts:
            break
        if time.monotonic() > stop:
            raise AssertionError(
                f"provider batch {pb} is still polled for its bill ({stuck.polls[pb]} polls "
                f"so far, the batch 'cancelling'); no stat:hedge_lost_batch_unknown: "
                f"{ {k: v for k, v in counts.items() if 'lost' in k or 'hedge' in k} }")
        time.sleep(0.5)
    # every turn of it was answered by the sync API: none of their bills is known
    assert counts["stat:hedge_lost_batch_unknown"] == N, counts
    assert "stat:hedge_lost_batch_paid" not in counts, counts
    # the provider bills the requests that completed before the cancel takes effect (all
    # but the held one); agentbatch did not learn it, and says so
    billed = sim_stats(sim.url)["batch_billed"]
    assert billed[MODEL]["requests"] == N - 1, billed
    assert f"provider batch {pb}" in worker.log() and "not known" in worker.log()

    # and it polls that batch no more (the count is written after its last poll)
    polled = stuck.polls[pb]
    time.sleep(2 * MAX_POLL_S + 1)
    assert stuck.polls[pb] == polled, (polled, stuck.polls[pb])
