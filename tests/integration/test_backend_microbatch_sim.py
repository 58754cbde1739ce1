"""MicroBatchingBackend against the real simulator over HTTP: concurrent tool-free agents become
one ``/v1/completions`` request, each answer goes back to its own caller, and a prompt that
makes the server fail the whole request does not fail its siblings."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest

from agentbatch.backends.microbatch import MicroBatchingBackend
from agentbatch.backends.openai_compat import OpenAICompatBackend
from agentbatch.core.model_io import ModelRequest, ModelResponse
from agentbatch.sim.config import SimConfig
from agentbatch.sim.server import SimServer

N = 30


@pytest.fixture
def sim() -> Iterator[SimServer]:
    with SimServer(SimConfig(fixed_ms=5)) as server:
        yield server


@pytest.fixture
async def batcher(sim: SimServer) -> AsyncIterator[MicroBatchingBackend]:
    inner = OpenAICompatBackend("sim://" + sim.url.split("://", 1)[1])
    # The window is far longer than the test: the batch is flushed by size, not by timing.
    backend = MicroBatchingBackend(inner, window_s=30.0, max_batch=N)
    yield backend
    await backend.aclose()


def request(i: int, extra: str = "") -> ModelRequest:
    # "@sim answer" is not the content's last line: ChatML closes it with "<|im_end|>" on the
    # same line, which would otherwise become part of the scripted answer.
    user = f"Item {i}.\n@sim answer item-{i}\n{extra}Thanks."
    return ModelRequest(
        model="agentbatch-sim",
        messages=[{"role": "system", "content": "Answer briefly."},
                  {"role": "user", "content": user}],
        request_id=f"agent-{i}",
    )


def requests_seen(sim: SimServer) -> dict[str, int]:
    return dict(sim.state.stats.as_dict()["requests"])


async def test_thirty_agents_one_http_request(sim: SimServer,
                                              batcher: MicroBatchingBackend) -> None:
    responses = await asyncio.gather(*(batcher.complete(request(i)) for i in range(N)))
    assert [r.text for r in responses] == [f"item-{i}" for i in range(N)]
    assert requests_seen(sim) == {"completions": 1}
    assert batcher.stats()["batches"] == 1 and batcher.requests_sent == 1
    total = sum(r.usage.prompt_tokens for r in responses)
    assert total == sim.state.stats.prompt_tokens  # the split usage adds up to the server's


async def test_a_prompt_that_fails_the_batch_is_retried_alone(
    sim: SimServer, batcher: MicroBatchingBackend
) -> None:
    reqs = [request(i, "@sim fail http_500 times=1\n" if i == 7 else "") for i in range(N)]
    results = await asyncio.gather(*(batcher.complete(r) for r in reqs),
                                   return_exceptions=True)
    # The simulator fails the whole batched request (one scripted 500). The inner backend then
    # sends every prompt on its own; prompt 7's fault was used up by the batch, so it succeeds.
    assert all(isinstance(r, ModelResponse) for r in results), results
    assert [r.text for r in results] == [  # type: ignore[union-attr]
        f"item-{i}" for i in range(N)
    ]
    stats = sim.state.stats.as_dict()
    assert stats["faults"] == {"http_500": 1}
    assert stats["requests"] == {"completions": 1 + N}
    assert batcher.stats()["batches"] == 1


async def test_a_prompt_that_keeps_failing_fails_alone(
    sim: SimServer, batcher: MicroBatchingBackend
) -> None:
    reqs = [request(i, "@sim fail http_500 times=2\n" if i == 3 else "") for i in range(N)]
    results = await asyncio.gather(*(batcher.complete(r) for r in reqs),
                                   return_exceptions=True)
    failed = [i for i, r in enumerate(results) if not isinstance(r, ModelResponse)]
    assert failed == [3]
    assert getattr(results[3], "status", None) == 500
    assert [r.text for i, r in enumerate(results) if i != 3] == [  # type: ignore[union-attr]
        f"item-{i}" for i in range(N) if i != 3
    ]
