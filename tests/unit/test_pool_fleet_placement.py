"""Where a distributed batch's first turns land: the same for every worker process.

Each worker process of a distributed batch has its own ``EndpointPool``. Placing a first turn
on the endpoint with the fewest requests in flight counts only that process's requests, so with
one turn in flight per process every first turn went to its agent's rendezvous hash home: on
the llama.cpp pool benchmark without a host cache, one round put three agents of four on one
server (18,020 of 20,499 prompt tokens computed there, 162.8 s against 50.7 and 58.3 s for the
other rounds). A worker's pool spreads first turns by the agent's number instead
(``spread_first_turns``): agent i of a batch starts on endpoint (i + offset) mod N, the offset a
hash of the batch id, so every process places an agent alike and a batch splits evenly.

Each "process" here is its own pool that places one turn, as a worker running one turn at a
time does.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from agentbatch.backends.affinity import spread
from agentbatch.backends.pool import EndpointPool
from agentbatch.backends.retry import RetryingBackend
from agentbatch.backends.setup import spread_first_turns
from agentbatch.core.model_io import ModelRequest
from tests.support.fake_backend import ScriptedBackend
from tests.unit.test_pool_options import _route_held

BATCHES = [f"batch-{n:02d}" for n in range(20)]


def _request(key: str) -> ModelRequest:
    return ModelRequest(model="m", messages=[{"role": "user", "content": key}], agent_key=key)


def _worker_pool(names: list[str], **kwargs: object) -> EndpointPool:
    pool = EndpointPool([ScriptedBackend(name=n) for n in names], **kwargs)  # type: ignore[arg-type]
    spread_first_turns(RetryingBackend(pool))  # what a worker does when it loads a batch
    return pool


async def _first_turns_per_endpoint(names: list[str], batch: str, agents: int) -> Counter[str]:
    """Each agent's first turn placed by a pool of its own (a process placing one turn)."""
    placed: Counter[str] = Counter()
    for i in range(agents):
        reply = await _worker_pool(names).complete(_request(f"{batch}:{i}"))
        placed[reply.endpoint or ""] += 1
    return placed


@pytest.mark.parametrize(("names", "agents"), [(["a", "b"], 4), (["a", "b"], 8),
                                               (["a", "b", "c"], 9)])
async def test_every_batch_splits_evenly_whichever_process_places_each_agent(
        names: list[str], agents: int) -> None:
    for batch in BATCHES:
        placed = await _first_turns_per_endpoint(names, batch, agents)
        assert sorted(placed.values()) == [agents // len(names)] * len(names), (batch, placed)


async def test_without_spreading_one_turn_per_process_goes_to_its_hash_home() -> None:
    # What the workers did before: a pool with nothing in flight places by the agent's
    # ranking, and over 20 batches of 4 agents some batch is not split 2/2.
    uneven = []
    for batch in BATCHES:
        placed: Counter[str] = Counter()
        for i in range(4):
            pool = EndpointPool([ScriptedBackend(name="a"), ScriptedBackend(name="b")])
            placed[(await pool.complete(_request(f"{batch}:{i}"))).endpoint or ""] += 1
        if sorted(placed.values()) != [2, 2]:
            uneven.append(batch)
    assert uneven, "every batch split evenly by hash: this test no longer shows the bug"


def test_batches_start_on_different_endpoints() -> None:
    # agent 0 of each batch does not always land on the first endpoint: one-agent batches on
    # a shared fleet would all go to it
    starts = {spread(f"{batch}:0", 2) for batch in BATCHES}
    assert starts == {0, 1}


def test_keys_that_are_not_an_agent_of_a_batch_are_not_spread() -> None:
    assert spread("batch-00:warmup", 2) is None
    assert spread("no-number", 2) is None
    assert spread("batch:7", 3) == (spread("batch:4", 3) or 0) % 3  # index 7 ≡ index 4


async def test_an_ejected_endpoints_agents_go_to_the_next_one() -> None:
    pool = _worker_pool(["a", "b", "c"])
    pool._eject(pool._eps[1], "test")
    batch = BATCHES[0]
    homes = {i: spread(f"{batch}:{i}", 3) for i in range(6)}
    replies = [await pool.complete(_request(f"{batch}:{i}")) for i in range(6)]
    for i, reply in enumerate(replies):
        expected = {0: "a", 1: "c", 2: "c"}[homes[i] or 0]
        assert reply.endpoint == expected, (i, homes[i], reply.endpoint)
    assert pool.moves() == {"load": 0, "failover": 0}  # a first turn has no home to leave


async def test_a_spread_endpoint_past_its_load_bound_passes_the_turn_on() -> None:
    # Five first turns of one batch in flight at once in one process, all spread onto "a"
    # (agents 0, 2, 4, ... of a two-endpoint pool). The bound with factor 1 and floor 2
    # (the mean load including the turn being placed, at least 2) lets "a" hold 2 while 3 or
    # 4 are in flight and 3 once 5 are; the others start on "b", and none counts as a move.
    hold = asyncio.Event()
    backends = [ScriptedBackend(name="a", hold=hold), ScriptedBackend(name="b", hold=hold)]
    pool = EndpointPool(list(backends), load_factor=1.0)
    spread_first_turns(pool)
    batch = next(b for b in BATCHES if spread(f"{b}:0", 2) == 0)
    tasks = await _route_held(pool, [f"{batch}:{i}" for i in range(0, 10, 2)])
    hold.set()
    replies = await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert [r.endpoint for r in replies] == ["a", "a", "b", "b", "a"]  # type: ignore[attr-defined]
    assert pool.moves() == {"load": 0, "failover": 0}


async def test_the_embedded_pool_still_places_by_what_is_in_flight() -> None:
    # one process sees the whole batch: fewest in flight is exact there, and not spread
    pool = EndpointPool([ScriptedBackend(name="a"), ScriptedBackend(name="b")])
    assert pool.spread_first_turns is False
