"""A turn moved for load takes its conversation along, on two real llama-servers
(``EndpointPool._carry``; llama.cpp's ``/slots`` save and restore).

Two servers sharing one ``--slot-save-path``: an agent's first turn runs on one; its second
is moved off it (the home's in-flight count is set past the load bound, so the move does not
depend on timing), and before it is sent the slot holding the conversation is saved there and
restored into a free slot of the other server, where the turn is pinned. The reply's cached
token count is the server's own: the turn computed its new message only. With a save
directory per server, the restore fails, nothing is carried, the pair is not tried again,
and the turn computes its conversation again. Assertions are agentbatch's decisions and the
server's counts, never what the model wrote.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from agentbatch.backends.llamacpp import LlamaCppBackend, carry_file
from agentbatch.backends.pool import EndpointPool
from agentbatch.core.model_io import ModelRequest, ModelResponse
from agentbatch.distributed.state.scripts import Scripts
from agentbatch.distributed.state.slot_map import FleetSlots
from agentbatch.engine import EnginePaths, LlamaServer
from tests.engine.test_llamacpp_warmup import MODEL, SYSTEM

pytestmark = pytest.mark.engine

AGENT = "carry:0"
PAGE = ("Section {n}: the pump must be primed before first use; check the seal, the valve and "
        "the filter, and write the reading in the log book with the date. ") * 6


def _messages(turn: int) -> list[dict[str, Any]]:
    """The agent's conversation at ``turn`` (1 or 2), with a fixed assistant reply."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Case {AGENT}: page 1. {PAGE.format(n=1)}"}]
    if turn == 2:
        messages += [{"role": "assistant", "content": "Read page 1."},
                     {"role": "user", "content": "Page 2: the valve."}]
    return messages


async def _move(urls: list[str]) -> tuple[ModelResponse, ModelResponse, str, EndpointPool]:
    """Turn 1 on the pool, then turn 2 with its home past the load bound: the replies, the
    home and the pool (its counters)."""
    backends = [LlamaCppBackend(u) for u in urls]
    pool = EndpointPool(list(backends), load_factor=1.0)
    try:
        for b in backends:  # the warm-up probe turns pinning on (``SlotPicker``), as preflight
            probe = await b.probe_cache(ModelRequest(
                model=MODEL, max_tokens=1, agent_key="carry:warmup",
                messages=[{"role": "system", "content": SYSTEM},
                          {"role": "user", "content": "ok"}]))
            assert probe is not None and probe.pinning_keeps_prefix, probe
        first = await pool.complete(ModelRequest(model=MODEL, max_tokens=1, temperature=0.0,
                                                 agent_key=AGENT, messages=_messages(1)))
        home = first.endpoint
        assert home is not None
        return first, await _loaded_home_turn(pool, home), home, pool
    finally:
        await pool.aclose()


def _two_workers(urls: list[str], redis_url: str
                 ) -> tuple[list[aioredis.Redis], list[list[LlamaCppBackend]]]:
    """Two workers' drivers for ``urls``, each worker on its own Redis client, every driver
    pinning through the fleet's slot map (``FleetSlots``, what ``share_fleet_slots`` hands a
    worker)."""
    clients = [aioredis.from_url(redis_url) for _ in range(2)]
    workers = []
    for client in clients:
        drivers = [LlamaCppBackend(u) for u in urls]
        for d in drivers:
            assert d.share_slots(FleetSlots(Scripts(client), d.name, 2, 120_000))
        workers.append(drivers)
    return clients, workers


async def _move_between_workers(urls: list[str], redis_url: str
                                ) -> tuple[ModelResponse, ModelResponse, str, EndpointPool]:
    """``_move`` on the distributed engine: turn 1 on one worker's pool, turn 2 on another
    worker's (``_two_workers``), so the second worker saves from the slot the first one's
    turn ran on."""
    clients, workers = _two_workers(urls, redis_url)
    pools = [EndpointPool(list(drivers), load_factor=1.0) for drivers in workers]
    try:
        first = await pools[0].complete(ModelRequest(
            model=MODEL, max_tokens=1, temperature=0.0, agent_key=AGENT,
            messages=_messages(1)))
        home = first.endpoint
        assert home is not None
        second = await _loaded_home_turn(pools[1], home)
        return first, second, home, pools[1]
    finally:
        for pool in pools:
            await pool.aclose()
        for client in clients:
            await client.aclose()


async def _loaded_home_turn(pool: EndpointPool, home: str) -> ModelResponse:
    """The agent's second turn, with its home past the pool's load bound: it moves."""
    index = [b.name for b in pool.backends].index(home)
    pool._eps[index].outstanding = 5  # past the bound (the floor, 2): the turn moves
    try:
        return await pool.complete(ModelRequest(
            model=MODEL, max_tokens=1, temperature=0.0, agent_key=AGENT, cached_on=home,
            messages=_messages(2)))
    finally:
        pool._eps[index].outstanding = 0


def _moved_on(engine_paths: EnginePaths, dirs: list[Path], redis_url: str | None = None
              ) -> tuple[ModelResponse, ModelResponse, str, EndpointPool]:
    """``_move`` (or, given Redis, ``_move_between_workers``) on two servers started with
    these ``--slot-save-path`` directories."""
    servers = [LlamaServer(engine_paths, parallel=2, threads=1,
                           extra_args=("--slot-save-path", str(d))) for d in dirs]
    try:
        for s in servers:
            s.start()
        urls = [s.llamacpp_url for s in servers]
        return asyncio.run(_move(urls) if redis_url is None
                           else _move_between_workers(urls, redis_url))
    finally:
        for s in servers:
            s.stop()


@pytest.mark.parametrize("engine", ["embedded", pytest.param("distributed",
                                                              marks=pytest.mark.redis)])
def test_a_moved_turn_finds_its_conversation_restored_where_it_went(
        engine_paths: EnginePaths, tmp_path: Path, engine: str,
        request: pytest.FixtureRequest) -> None:
    """On the distributed engine the turns run on two workers' pools, pinned through the
    fleet's slot map: the worker moving the turn saves from the slot the other one's turn
    ran on."""
    redis_url = request.getfixturevalue("redis_url") if engine == "distributed" else None
    first, second, home, pool = _moved_on(engine_paths, [tmp_path, tmp_path], redis_url)
    assert second.endpoint not in (None, home)
    assert pool.moves() == {"load": 1, "failover": 0}
    assert pool.carries() == {"carried": 1, "not_carried": 0}
    # one file, named for the home slot the conversation was saved from
    assert [p.name for p in tmp_path.iterdir()] in ([carry_file(home, 0)], [carry_file(home, 1)])
    # the server found the whole first turn cached: it computed the new message only
    assert second.usage.cached_tokens >= first.usage.prompt_tokens - 8, (first.usage,
                                                                        second.usage)
    computed = second.usage.prompt_tokens - second.usage.cached_tokens
    assert computed <= second.usage.prompt_tokens - first.usage.prompt_tokens + 8, second.usage


def test_servers_that_share_no_save_directory_carry_nothing(
        engine_paths: EnginePaths, tmp_path: Path) -> None:
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    first, second, home, pool = _moved_on(engine_paths, dirs)
    assert second.endpoint not in (None, home)
    assert pool.carries() == {"carried": 0, "not_carried": 1}
    assert len(pool._no_carry) == 1  # that pair is not tried again
    # the turn computed its conversation again where it went: all the first turn computed
    # (the shared system prompt aside, which the warm-up left cached on both servers)
    computed = second.usage.prompt_tokens - second.usage.cached_tokens
    assert computed >= first.usage.prompt_tokens - first.usage.cached_tokens, (first.usage,
                                                                               second.usage)


async def _crossed_carries(urls: list[str], redis_url: str) -> tuple[ModelResponse,
                                                                      ModelResponse]:
    """Two workers' pools each move an agent off server A to server B at about the same
    time: both conversations are saved before either is restored (the order two
    processes can take; set here, not left to timing). Agent 0's first turn and its moved
    second turn."""
    clients, workers = _two_workers(urls, redis_url)
    keys = ["carry:0", "carry:1"]

    def conversation(key: str, turn: int) -> list[dict[str, Any]]:
        return [{**m, "content": m["content"].replace(AGENT, key)} for m in _messages(turn)]

    try:
        firsts = [await w[0].complete(ModelRequest(
            model=MODEL, max_tokens=1, temperature=0.0, agent_key=k,
            messages=conversation(k, 1))) for w, k in zip(workers, keys, strict=True)]
        names = [await w[0].save_conversation(k) for w, k in zip(workers, keys, strict=True)]
        assert None not in names and names[0] != names[1], names  # one file per home slot
        assert await workers[0][1].restore_conversation(keys[0], names[0] or "")
        second = await workers[0][1].complete(ModelRequest(
            model=MODEL, max_tokens=1, temperature=0.0, agent_key=keys[0],
            messages=conversation(keys[0], 2)))
        return firsts[0], second
    finally:
        for w in workers:
            for d in w:
                await d.aclose()
        for client in clients:
            await client.aclose()


@pytest.mark.redis
def test_two_workers_carrying_to_one_server_at_once_each_restore_their_own(
        engine_paths: EnginePaths, tmp_path: Path, redis_url: str) -> None:
    servers = [LlamaServer(engine_paths, parallel=2, threads=1,
                           extra_args=("--slot-save-path", str(tmp_path))) for _ in range(2)]
    try:
        for s in servers:
            s.start()
        first, second = asyncio.run(_crossed_carries([s.llamacpp_url for s in servers],
                                                     redis_url))
    finally:
        for s in servers:
            s.stop()
    # the moved turn found its own first turn cached, not the other agent's conversation
    assert second.usage.cached_tokens >= first.usage.prompt_tokens - 8, (first.usage,
                                                                        second.usage)
