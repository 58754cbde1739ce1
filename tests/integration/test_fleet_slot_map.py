"""The fleet's slot map, on one real redis-server: every worker pins an agent's turns alike.

The embedded engine pins an agent's turns to the llama.cpp slot holding its conversation
(``SlotPicker``). A distributed batch's turns run on any worker: ``FleetSlots`` keeps the
same decisions in Redis (``lua/slot_take.lua``, ``lua/slot_give.lua``). Each ``FleetSlots``
here has its own Redis client, as each worker process has; the last test runs a batch on two
real worker processes against a llama-server's HTTP surface (``FakeLlamaServer``) and reads
the ``id_slot`` each turn was sent with.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from aiohttp import web

from agentbatch import submit_batch
from agentbatch.backends.llamacpp import Placement
from agentbatch.core.plan import BatchPlan
from agentbatch.distributed.state.keys import BatchKeys, slot_map_key
from agentbatch.distributed.state.scripts import Scripts
from agentbatch.distributed.state.slot_map import CALL_TIMEOUT_S, IDLE_MS, FleetSlots
from tests.integration.test_backend_llamacpp import FakeLlamaServer
from tests.support.redis_server import free_port
from tests.support.tools import ShortAnswer, lookup

pytestmark = [pytest.mark.redis]

SERVER = "llamacpp://10.0.0.1:8080"  # a name only: nothing is sent to it here


@pytest.fixture
async def clients(redis_url: str) -> AsyncIterator[list[aioredis.Redis]]:
    """Two Redis clients: two worker processes' views of one map."""
    made = [aioredis.from_url(redis_url) for _ in range(2)]
    yield made
    for client in made:
        await client.aclose()


def fleet(client: aioredis.Redis, slots: int = 2, ttl_ms: int = 60_000) -> FleetSlots:
    return FleetSlots(Scripts(client), SERVER, slots, ttl_ms)


async def turn(slots: FleetSlots, agent: str, first: bool, ran: int | None = None
               ) -> Placement:
    """One whole turn: placed, then given back (``ran``: where the server said it ran)."""
    place = await slots.acquire(agent, first)
    await slots.release(place, agent, ran)
    return place


async def test_two_workers_pin_an_agents_turns_to_the_same_slot(
        clients: list[aioredis.Redis]) -> None:
    a, b = fleet(clients[0]), fleet(clients[1])
    assert await turn(a, "b:0", first=True) == Placement(0, 0)
    # a picker of B's own would have pinned b:1 to slot 0 too, over b:0's conversation
    assert await turn(b, "b:1", first=True) == Placement(1, 1)
    assert await turn(b, "b:0", first=False) == Placement(0, 0)
    assert await turn(a, "b:1", first=False) == Placement(1, 1)
    held = await clients[0].hgetall(slot_map_key(SERVER))
    assert held[b"h0"] == b"b:0" and held[b"h1"] == b"b:1"
    assert held[b"b0"] == held[b"b1"] == b"0"


async def test_a_turn_whose_slot_is_busy_or_taken_goes_unpinned(
        clients: list[aioredis.Redis]) -> None:
    a, b = fleet(clients[0]), fleet(clients[1])
    zero = await a.acquire("b:0", True)
    one = await b.acquire("b:1", True)
    assert (zero, one) == (Placement(0, 0), Placement(1, 1))
    # every slot busy: unpinned and counted nowhere
    assert await a.acquire("b:2", True) == Placement(None, None)
    await a.release(zero, "b:0", None)
    await b.release(one, "b:1", None)
    # both slots hold a conversation: b:2 is not pinned over one; the server picks and
    # restores, counted on the free slot used longest ago (0)
    late = await a.acquire("b:2", True)
    assert late == Placement(None, 0)
    await a.release(late, "b:2", 1)  # the server said it ran on slot 1
    held = await clients[0].hgetall(slot_map_key(SERVER))
    assert held[b"h1"] == b"b:2" and held[b"h0"] == b"b:0"
    # b:1's slot was taken: its next turn goes unpinned, so llama.cpp restores its
    # conversation rather than a pinned turn computing it again
    assert (await b.acquire("b:1", False)).send is None
    # an agent whose conversation moved is held by one slot only
    await turn(b, "b:0", first=False, ran=None)
    moved = await b.acquire("b:0", False)
    await b.release(Placement(None, moved.slot), "b:0", 1 - (moved.slot or 0))
    held = await clients[0].hgetall(slot_map_key(SERVER))
    assert [k for k, v in held.items() if v == b"b:0"] == [f"h{1 - (moved.slot or 0)}".encode()]


async def test_a_carry_saves_from_the_agents_idle_slot_and_restores_into_a_free_one(
        clients: list[aioredis.Redis]) -> None:
    a, b = fleet(clients[0]), fleet(clients[1])
    await turn(a, "b:0", first=True)  # slot 0 holds b:0
    assert await b.held("b:9") is None  # nobody's slot holds b:9
    saving = await b.held("b:0")
    assert saving == Placement(0, 0)
    assert await a.held("b:0") is None  # counted busy while it is saved
    # a restore claims a slot holding nobody's first
    restoring = await a.claim()
    assert restoring == Placement(1, 1)
    assert await b.claim() is None  # both counted busy now
    await b.release(saving, "b:0", None)
    await a.release(restoring, "b:7", None)  # restored: slot 1 holds b:7's conversation
    held = await clients[0].hgetall(slot_map_key(SERVER))
    assert held[b"h0"] == b"b:0" and held[b"h1"] == b"b:7"
    assert held[b"b0"] == held[b"b1"] == b"0"
    # the restored agent's next turn is pinned where it was restored
    assert await turn(b, "b:7", first=False) == Placement(1, 1)
    # a restore that failed leaves its slot holding nobody's
    failed = await a.claim()
    assert failed is not None and failed.slot is not None
    await a.release(failed, "", None)
    assert await clients[0].hget(slot_map_key(SERVER), f"h{failed.slot}") in (None, b"")


async def test_a_dead_workers_turn_stops_counting_at_its_deadline(
        clients: list[aioredis.Redis]) -> None:
    dead, live = fleet(clients[0], ttl_ms=300), fleet(clients[1])
    assert await dead.acquire("b:0", True) == Placement(0, 0)  # its worker dies: no release
    assert await live.acquire("b:1", True) == Placement(1, 1)
    assert await live.acquire("b:2", True) == Placement(None, None)
    deadline = time.monotonic() + 10
    while (place := await live.acquire("b:2", True)) == Placement(None, None):
        assert time.monotonic() < deadline, "the dead worker's count never lapsed"
        await asyncio.sleep(0.05)
    assert place == Placement(0, 0)


async def test_the_map_stays_one_entry_per_slot_and_expires_once_idle(
        clients: list[aioredis.Redis]) -> None:
    a = fleet(clients[0], slots=2)
    for n in range(60):
        await turn(a, f"b:{n}", first=n < 30, ran=n % 2)
    key = slot_map_key(SERVER)
    assert set(await clients[0].hkeys(key)) <= {f"{f}{s}".encode() for f in "hbeu" for s in (0, 1)}
    assert 0 < await clients[0].pttl(key) <= IDLE_MS


async def test_redis_that_does_not_answer_sends_turns_unpinned() -> None:
    client = aioredis.Redis(port=free_port(), socket_connect_timeout=0.5, socket_timeout=0.5)
    slots = fleet(client)
    started = time.monotonic()
    try:
        place = await slots.acquire("b:0", True)
        await slots.release(Placement(0, 0), "b:0", None)  # does not raise
    finally:
        await client.aclose()
    assert place == Placement(None, None)
    assert time.monotonic() - started < 2 * CALL_TIMEOUT_S + 2


class ToolingLlama(FakeLlamaServer):
    """The fake llama-server (4 slots): an agent's first turn calls ``lookup``, its second
    answers; the warm-up's requests (no question in them) are answered as usual.
    Unstreamed (``?stream=0``)."""

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        asked = re.findall(r"Question (\d+)", json.dumps(body["messages"]))
        if not asked or any(m["role"] == "tool" for m in body["messages"]):
            return await super()._chat(request)  # the body is read once, then cached
        self._record("chat", body)
        n = asked[-1]
        call = {"id": f"call_{n}", "type": "function",
                "function": {"name": "lookup", "arguments": json.dumps({"key": f"k{n}"})}}
        return web.json_response({
            "id": "c1", "object": "chat.completion", "model": "smol",
            "choices": [{"index": 0, "finish_reason": "tool_calls",
                         "message": {"role": "assistant", "content": None,
                                     "tool_calls": [call]}}],
            "usage": {"prompt_tokens": 20, "completion_tokens": 6, "total_tokens": 26,
                      "prompt_tokens_details": {"cached_tokens": 16}}})


@pytest.fixture
def tooling_llama() -> Iterator[ToolingLlama]:
    with ToolingLlama() as server:
        yield server


def test_a_distributed_batchs_workers_pin_each_agent_to_one_slot(
        tooling_llama: ToolingLlama, redis_url: str, start_workers: Any) -> None:
    """4 agents (a tool round, then an answer) on a 4-slot server, 2 worker processes: the
    submitter's probe finds pinning keeps the prefix (the plan says so), and every turn goes
    with the ``id_slot`` of its agent's slot, a slot per agent. Before the map, the workers
    sent none."""
    start_workers(2, concurrency=4, env={"AGENTBATCH_WORKER_IMPORTS": "tests.support",
                                         "TEST_TOOL_COUNT": "0", "TEST_TOOL_SLEEP_S": "0.05"})
    url = tooling_llama.url + "?stream=0"
    handle = submit_batch("Question {i}: look it up, then answer.",
                          [{"i": i} for i in range(4)], model="smol", backend=url,
                          tools=[lookup], tool_calling="native", output_schema=ShortAnswer,
                          redis_url=redis_url)
    results = handle.wait(timeout=120)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:2]
    with redis.Redis.from_url(redis_url) as client:
        raw = client.get(BatchKeys(handle.batch_id).plan)
    assert isinstance(raw, bytes)
    plan = BatchPlan.model_validate_json(raw)
    assert list(plan.pinned_slots.values()) == [4], plan.pinned_slots
    sent: dict[str, list[Any]] = {}
    for body in tooling_llama.bodies["chat"]:
        found = re.findall(r"Question (\d+)", json.dumps(body["messages"]))
        if found and body.get("max_tokens") != 1:  # the agents' turns, not the probe's
            sent.setdefault(found[-1], []).append(body.get("id_slot"))
    assert sorted(sent) == ["0", "1", "2", "3"], sent
    assert all(len(slots) >= 2 and set(slots) == {slots[0]} and slots[0] is not None
               for slots in sent.values()), sent
    assert len({slots[0] for slots in sent.values()}) == 4, sent
