"""A provider batch ends with its slowest request, so a big one takes longer than a small one.
The p90 hedge of a waiting batch turn counts only provider batches of a similar size: three
one-turn batches answered in a poll must not make a 300-turn batch still on course look like a
straggler and send all its turns to the sync API at full price (bench_cost.py saw 1,905 of
3,000 turns hedged, all won by sync, with a deadline twice the all-batch wall). Real HTTP to
the simulator's OpenAI files + batches endpoints."""

from __future__ import annotations

import asyncio

from agentbatch.backends.openai_compat import OpenAICompatBackend
from agentbatch.backends.provider_batch import batch_client
from agentbatch.core.model_io import ModelRequest
from agentbatch.sim import SimServer
from agentbatch.sim.batch_api import BATCH_API
from agentbatch.sim.config import SimConfig
from agentbatch.turnloop.batch_turns import ProviderBatchTurns

MODEL = "sim-model"
BIG = 300


def _request(i: int) -> ModelRequest:
    return ModelRequest(model=MODEL, messages=[{"role": "user", "content": f"Agent {i}."}],
                        max_tokens=16)


def test_small_batches_do_not_set_the_p90_that_hedges_a_big_one(monkeypatch) -> None:
    # provider batches are capped at the client's max_items turns (test_batch_lockstep.py);
    # sizes still differ (the last chunk of a round, a quiet window), so the filter is
    # tested on one big
    # median 50 ms, sigma 1: a one-turn batch is seen at the first poll, a 300-turn batch's
    # slowest request (~1 s) several polls later, past the p90 of the one-turn batches
    config = SimConfig(fixed_ms=5, batch_latency_s=0.05, batch_latency_spread=1.0)

    async def main() -> tuple[dict[str, int], list[bool], int]:
        with SimServer(config) as sim:
            backend = OpenAICompatBackend("sim://" + sim.url.split("://", 1)[1])
            client = await batch_client(backend)
            assert client is not None
            monkeypatch.setattr(client, "max_items", BIG)
            turns = ProviderBatchTurns(client, backend, mode="batch", deadline=None,
                                       total=3 + BIG)
            try:
                served = [(await turns.complete(_request(i), 1))[1] for i in range(3)]
                big = await asyncio.wait_for(asyncio.gather(
                    *(turns.complete(_request(10 + i), 1) for i in range(BIG))), 120)
                served += [by_batch for _, by_batch in big]
            finally:
                await turns.aclose()
                await backend.aclose()
            api = sim._runner.app[BATCH_API]  # type: ignore[union-attr]
            items = sum(len(job.items) for job in api.jobs.values())
            assert sim.state.stats.as_dict()["requests_total"] == turns.stats["hedged"]
            return dict(turns.stats), served, items

    stats, served, items = asyncio.run(main())
    assert stats["provider_batches"] == 4 and items == 3 + BIG
    assert stats.get("hedged", 0) == 0, stats  # nothing sent to the sync API
    assert all(served) and stats["served_batch"] == 3 + BIG
