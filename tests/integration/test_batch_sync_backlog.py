"""``pricing="auto"`` estimates a sync turn behind the sync path's backlog, not as one request.

Many turns sent to the sync API at once queue (inference slots, the client's in-flight cap,
the server) and finish late. bench_cost.py at 1.1x the all-batch wall routed 1,197 turns and
hedged 815 at the one-request estimate (~50 ms) and left 827 of 1,000 agents past a deadline
the all-batch run met. These tests assert the decisions (when a turn hedges, where it is
routed) given a backlog, over real HTTP to the simulator's sync and batch endpoints."""

from __future__ import annotations

import asyncio
import time

from agentbatch.backends.openai_compat import OpenAICompatBackend
from agentbatch.backends.provider_batch import batch_client
from agentbatch.core.model_io import ModelRequest
from agentbatch.sim import SimServer
from agentbatch.sim.config import SimConfig
from agentbatch.turnloop.batch_turns import ProviderBatchTurns

MODEL = "sim-model"
N = 100  # batch turns waiting
ROUTES = 400  # agents routed at once: the first ~5 s / 50 ms go to the sync API, then none
CONFIG = SimConfig(fixed_ms=50, batch_latency_s=600.0, batch_latency_spread=0.0)


def _request(i: int) -> ModelRequest:
    return ModelRequest(model=MODEL, messages=[{"role": "user", "content": f"Agent {i}."}],
                        max_tokens=16)


async def _turns(sim: SimServer, deadline_in: float) -> tuple[ProviderBatchTurns,
                                                               OpenAICompatBackend]:
    backend = OpenAICompatBackend("sim://" + sim.url.split("://", 1)[1])
    client = await batch_client(backend)
    assert client is not None
    turns = ProviderBatchTurns(client, backend, mode="auto",
                               deadline=time.monotonic() + deadline_in, total=N)
    assert turns.route(3, N) == "sync"  # the probe: the sync latency is measured
    await turns.sync(_request(0))
    return turns, backend


def test_waiting_batch_turns_hedge_early_enough_for_the_sync_path_to_take_them_all() -> None:
    async def main() -> tuple[float, float, float]:
        with SimServer(CONFIG) as sim:
            turns, backend = await _turns(sim, 3600.0)  # far: nothing hedges in the test
            waiting = [asyncio.create_task(turns.complete(_request(1 + i), 1))
                       for i in range(N)]
            try:
                for _ in range(600):
                    if len(turns._futures) == N:
                        break
                    await asyncio.sleep(0.05)
                assert len(turns._futures) == N
                assert turns.deadline is not None
                margin = turns.router.safety()  # kept free before the deadline anyway
                room = turns.deadline - margin - (turns._hedge_at("t", time.monotonic(), 1, None)
                                                  or 0.0)
                median = turns.sync_latency.quantile(0.5)
                p90 = turns.sync_latency.quantile(0.9)
                assert median is not None and p90 is not None
                return room, median, p90
            finally:
                for task in waiting:
                    task.cancel()
                await asyncio.gather(*waiting, return_exceptions=True)
                await turns.aclose()
                await backend.aclose()

    room, median, p90 = asyncio.run(main())
    # the old hedge left one request's latency (p90) before the deadline for all N turns;
    # with the sync path seen answering only one at a time, they take N requests' time
    assert room >= 0.9 * N * median, (room, median)
    assert room > 10 * p90


def test_a_backed_up_sync_path_is_not_sent_more_turns_than_a_batch_round_would_take() -> None:
    async def main() -> tuple[list[str], dict[str, int], int, int]:
        with SimServer(CONFIG) as sim:
            turns, backend = await _turns(sim, 3600.0)
            for _ in range(3):  # provider batches of 8 seen to take 5 s
                turns.batch_latency.add(5.0, 8)
            # a deadline each agent's batch turn would miss: the old estimate (one request
            # per sync turn) routed every one of them to the sync API
            turns.deadline = time.monotonic() + 5.5
            routes = [turns.route(2, N) for _ in range(ROUTES)]
            backlog = turns.sync_path.backlog
            routed = routes.count("sync")
            try:  # the routed turns are answered: the backlog drains to nothing
                await asyncio.gather(*(turns.sync(_request(1 + i)) for i in range(routed)))
            finally:
                await turns.aclose()
                await backend.aclose()
            return routes, dict(turns.stats), backlog, turns.sync_path.backlog

    routes, stats, backlog, drained = asyncio.run(main())
    routed = routes.count("sync")
    assert routes[0] == "sync" and 0 < routed < ROUTES, routes
    assert routes[routed:] == ["batch"] * (ROUTES - routed)  # once backed up, it stays so
    assert stats["kept_batch_sync_backed_up"] == ROUTES - routed
    assert backlog == routed and drained == 0
