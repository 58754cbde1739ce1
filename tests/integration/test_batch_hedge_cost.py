"""A provider-batch turn hedged to the sync API whose batch answer came first: the sync
request was sent and is cancelled, so its prompt was paid. The batch's reply carries it
(``hedge_usage``) into ``cost_usd`` and the spend at the sync prices, as a pool's hedge does
(test_hedge_cost_embedded.py). Real HTTP to the simulator, whose sync API is slow enough that
the batch answer always wins; the answer itself is handed to the waiting turn by the test."""

from __future__ import annotations

import asyncio
import time

from agentbatch.backends.openai_compat import OpenAICompatBackend
from agentbatch.backends.provider_batch import ItemResult, batch_client
from agentbatch.core.model_io import ModelRequest, ModelResponse, Usage
from agentbatch.core.pricing import cost_usd
from agentbatch.sim import SimServer
from agentbatch.sim.config import SimConfig
from agentbatch.turnloop.batch_turns import ProviderBatchTurns, with_sync_loser
from tests.support.provider_batch import MODEL, PRICES, sim_url

BATCH_REPLY = ModelResponse(text="from the batch",
                            usage=Usage(prompt_tokens=40, completion_tokens=7))


def test_a_hedge_the_batch_wins_pays_the_cancelled_sync_requests_prompt() -> None:
    async def main() -> tuple[ModelResponse, bool, int]:
        with SimServer(SimConfig(fixed_ms=60_000, batch_latency_s=600.0)) as sim:
            backend = OpenAICompatBackend(sim_url(sim))
            client = await batch_client(backend)
            assert client is not None
            turns = ProviderBatchTurns(client, backend, mode="batch", deadline=None, total=1)
            future: asyncio.Future[ItemResult] = asyncio.get_running_loop().create_future()
            request = ModelRequest(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                   max_tokens=16)
            try:
                hedged = asyncio.ensure_future(turns._hedge("t0", request, future))
                stop = time.monotonic() + 30
                while not sim.state.stats.requests:  # the sync request reached the server
                    assert time.monotonic() < stop, "the hedge's sync request never arrived"
                    await asyncio.sleep(0.01)
                future.set_result(ItemResult("t0", response=BATCH_REPLY))
                reply, by_batch = await asyncio.wait_for(hedged, 30)
            finally:
                await turns.aclose()
                await backend.aclose()
            return reply, by_batch, turns.stats["hedge_won_by_batch"]

    reply, by_batch, won = asyncio.run(main())
    assert by_batch and won == 1 and reply.text == "from the batch"
    # the cancelled sync request's prompt: the same request, so the batch reply's prompt
    assert reply.hedge_usage == Usage(prompt_tokens=40)
    assert cost_usd(reply.hedge_usage, PRICES[MODEL]) > 0


def _done(result: object = None, error: BaseException | None = None) -> asyncio.Future[object]:
    loop = asyncio.new_event_loop()
    try:
        future: asyncio.Future[object] = loop.create_future()
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
        return future
    finally:
        loop.close()


def test_a_sync_loser_that_answered_too_is_paid_exactly_and_one_that_failed_not_at_all() -> None:
    answered = ModelResponse(text="sync", usage=Usage(prompt_tokens=40, completion_tokens=9))
    assert with_sync_loser(BATCH_REPLY, _done(answered)).hedge_usage == answered.usage
    failed = _done(error=RuntimeError("HTTP 500"))
    assert with_sync_loser(BATCH_REPLY, failed).hedge_usage is None
    failed.exception()  # retrieved: no "never retrieved" warning
