"""An agent's turn goes to the pool endpoint that answered its last turn, where its
conversation is cached: the reply names it (``ModelResponse.endpoint``), the turn machine keeps
it (``AgentState.endpoint``) and the next request carries it (``ModelRequest.cached_on``).

Before, a home was only the rendezvous hash of the agent's key: an agent moved off a loaded
home came back on its next turn, to a server that did not hold its conversation (on the
llama.cpp pool benchmark, 4 agents of 7 turns: 11 such moves, 11,668 prompt tokens computed
against 8,270 for a client pinning agents by hash). A first turn, with nothing cached anywhere,
goes to the least-loaded endpoint: placing it by hash put three agents of four on one server in
two rounds of three there, and the moves off it cost their caches. The routing tests drive an
``EndpointPool`` over scripted backends that hold every request until released, so the load
each decision sees is set by the test, not a scheduler.
"""

from __future__ import annotations

import asyncio

from agentbatch.backends.affinity import rank
from agentbatch.backends.pool import EndpointPool
from agentbatch.core.agent_state import AgentState
from agentbatch.core.model_io import ModelRequest, ModelResponse
from agentbatch.core.output import OutputContract
from agentbatch.core.turns import ModelReplied, TurnPolicy, step
from tests.support.fake_backend import ScriptedBackend
from tests.unit.test_pool_options import _route_held

NAMES = ["a", "b"]


def _homed_on(index: int, n: int) -> list[str]:
    keys = (f"agent-{i}" for i in range(10_000))
    return [k for k in keys if rank(k, NAMES)[0] == index][:n]


def _request(key: str, cached_on: str | None = None) -> ModelRequest:
    return ModelRequest(model="m", messages=[{"role": "user", "content": key}], agent_key=key,
                        cached_on=cached_on)


async def test_a_turn_goes_where_the_agents_last_turn_ran_not_to_its_hash_home() -> None:
    backends = [ScriptedBackend(name="a"), ScriptedBackend(name="b")]
    pool = EndpointPool(list(backends))
    key = _homed_on(0, 1)[0]
    first = await pool.complete(_request(key))
    assert first.endpoint == "a"  # no turn yet, an idle pool: ties go by its ranking
    moved = await pool.complete(_request(key, cached_on="b"))
    assert moved.endpoint == "b" and [b.calls for b in backends] == [1, 1]
    assert pool.moves() == {"load": 0, "failover": 0}  # it went where it was: not a move


async def test_an_endpoint_the_pool_does_not_have_is_placed_like_a_first_turn() -> None:
    backends = [ScriptedBackend(name="a"), ScriptedBackend(name="b")]
    pool = EndpointPool(list(backends))
    key = _homed_on(1, 1)[0]
    reply = await pool.complete(_request(key, cached_on="gone"))  # e.g. resumed on a new pool
    assert reply.endpoint == "b" and pool.moves() == {"load": 0, "failover": 0}


async def test_a_moved_agent_stays_where_it_moved() -> None:
    # four agents whose conversations are on "a", in flight at once with factor 1: the third
    # and fourth move to "b" (the bound is the floor, 2). Their next turns, with "a" idle, stay
    # on "b".
    hold = asyncio.Event()
    backends = [ScriptedBackend(name="a", hold=hold), ScriptedBackend(name="b", hold=hold)]
    pool = EndpointPool(list(backends), load_factor=1.0)
    keys = _homed_on(0, 4)
    tasks = await _route_held(pool, keys, cached_on="a")
    hold.set()
    replies = await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert [r.endpoint for r in replies] == ["a", "a", "b", "b"]
    assert pool.moves() == {"load": 2, "failover": 0}
    again = [await pool.complete(_request(k, cached_on=r.endpoint))
             for k, r in zip(keys, replies, strict=True)]
    assert [r.endpoint for r in again] == ["a", "a", "b", "b"]
    assert pool.moves() == {"load": 2, "failover": 0}  # none went back to its hash home


async def test_first_turns_are_spread_by_load_not_by_hash() -> None:
    # four agents whose rendezvous home is "a", first turns in flight at once: they split 2/2
    # (before: a, a, b, a, the third counted as a load move), and no move is counted since
    # none had a home yet. Their second turns each go where their first ran.
    hold = asyncio.Event()
    backends = [ScriptedBackend(name="a", hold=hold), ScriptedBackend(name="b", hold=hold)]
    pool = EndpointPool(list(backends))
    keys = _homed_on(0, 4)
    tasks = await _route_held(pool, keys)
    hold.set()
    replies = await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert [r.endpoint for r in replies] == ["a", "b", "a", "b"]
    assert pool.moves() == {"load": 0, "failover": 0}
    again = [await pool.complete(_request(k, cached_on=r.endpoint))
             for k, r in zip(keys, replies, strict=True)]
    assert [r.endpoint for r in again] == ["a", "b", "a", "b"]
    assert pool.moves() == {"load": 0, "failover": 0}


def test_the_turn_machine_keeps_the_endpoint_that_answered() -> None:
    policy = TurnPolicy(max_turns=4, max_retries=1, parse_output=OutputContract(None).parse)
    state = AgentState(index=0, input={})
    replied = step(policy, state, ModelReplied(ModelResponse(text="hi", endpoint="b")))
    assert replied.endpoint == "b"
    # a reply off a pool (no endpoint) leaves the last one known
    state = state.model_copy(update={"endpoint": "a"})
    assert step(policy, state, ModelReplied(ModelResponse(text="hi"))).endpoint == "a"
