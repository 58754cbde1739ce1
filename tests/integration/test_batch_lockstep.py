"""A provider batch answers only once its slowest request is done (OpenAI's output file and
Anthropic's ``results_url`` exist only when the whole batch has ended; the simulator models
the same), so every turn sent in one provider batch waits for the slowest of them. With all
ready turns in one provider batch, 1,000 agents moved in lock-step, each round as long as the
slowest of ~1,000 requests (bench_cost.py: ``pricing="auto"`` at 0.875 of all-sync). Provider
batches are capped at ``MAX_ITEMS`` turns, so a slow request holds only the few turns of its own
batch. Real HTTP to the simulator's OpenAI files + batches endpoints."""

from __future__ import annotations

import asyncio

from agentbatch.backends.openai_compat import OpenAICompatBackend
from agentbatch.backends.provider_batch import batch_client
from agentbatch.core.model_io import ModelRequest
from agentbatch.sim import SimServer
from agentbatch.sim.batch_api import BATCH_API
from agentbatch.sim.config import SimConfig
from agentbatch.turnloop.batch_turns import MAX_ITEMS, ProviderBatchTurns

MODEL = "sim-model"
TURNS = 40
WAIT_S = 120.0  # generous: the machine is shared; the answers come in well under a second


def _request(i: int, held: bool = False) -> ModelRequest:
    text = f"Agent {i}." + ("\n@simbatch hold" if held else "")  # held: never finishes
    return ModelRequest(model=MODEL, messages=[{"role": "user", "content": text}],
                        max_tokens=16, request_id=f"agent{i}")


def test_a_slow_request_holds_only_the_turns_of_its_own_provider_batch() -> None:
    config = SimConfig(fixed_ms=5, batch_latency_s=0.05, batch_latency_spread=0.0)

    async def main() -> tuple[list[int], set[int], dict[str, int]]:
        with SimServer(config) as sim:
            backend = OpenAICompatBackend("sim://" + sim.url.split("://", 1)[1])
            client = await batch_client(backend)
            assert client is not None
            turns = ProviderBatchTurns(client, backend, mode="batch", deadline=None,
                                       total=TURNS)
            tasks = {i: asyncio.ensure_future(turns.complete(_request(i, held=i == 0), 1))
                     for i in range(TURNS)}  # all ready in the same window
            try:
                api = sim._runner.app[BATCH_API]  # type: ignore[union-attr]
                while sum(len(job.items) for job in api.jobs.values()) < TURNS:
                    await asyncio.sleep(0.05)
                sizes = sorted(len(job.items) for job in api.jobs.values())
                held = next(job for job in api.jobs.values()
                            if any("hold" in str(it.body) for it in job.items))
                siblings = {int(it.body["messages"][0]["content"].split()[1].rstrip("."))
                            for it in held.items}
                assert len(siblings) <= TURNS // 4, (
                    f"the held request's provider batch holds {len(siblings)} of {TURNS} "
                    "turns, all waiting for it")
                # every turn outside the held request's provider batch is answered by the
                # batch API; the held one's batch-mates still wait (lock-step within a batch)
                others = [t for i, t in tasks.items() if i not in siblings]
                done, _ = await asyncio.wait(others, timeout=WAIT_S)
                assert len(done) == len(others), (len(done), len(others), sizes)
                assert all(t.result()[1] for t in others)  # served by the batch API
                assert not any(tasks[i].done() for i in siblings)
                return sizes, siblings, dict(turns.stats)
            finally:
                for t in tasks.values():
                    t.cancel()
                await asyncio.gather(*tasks.values(), return_exceptions=True)
                await turns.aclose()
                await backend.aclose()

    sizes, siblings, stats = asyncio.run(main())
    assert max(sizes) <= MAX_ITEMS and sum(sizes) == TURNS, sizes
    assert len(siblings) <= MAX_ITEMS and stats.get("hedged", 0) == 0, stats
