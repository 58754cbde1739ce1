"""A turn moved off its agent's home for load takes its conversation along
(``EndpointPool._carry``): saved on the home (``save_conversation``), restored where the turn
goes (``restore_conversation``), before the turn is sent, so that server computes only what is
new. Scripted backends hold every turn until released, so the load each routing decision sees
is set by the test; what each backend was asked to save and restore is recorded. The real
llama-server side: tests/engine/test_engine_pool_carry.py."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from agentbatch.backends.llamacpp import carry_file
from agentbatch.backends.pool import EndpointPool
from agentbatch.core.errors import BackendUnavailable
from agentbatch.core.model_io import ModelRequest, ModelResponse
from tests.support.fake_backend import ScriptedBackend
from tests.unit.test_pool_cached_on import _homed_on
from tests.unit.test_pool_options import _route_held


class Carrying(ScriptedBackend):
    """A scripted endpoint that records the conversations it saves and restores; ``saves``
    and ``restores`` say what it answers."""

    def __init__(self, name: str, hold: asyncio.Event, *, saves: bool = True,
                 restores: bool = True) -> None:
        super().__init__(name=name, hold=hold)
        self.saves, self.restores = saves, restores
        self.saved: list[tuple[str, str]] = []
        self.restored: list[tuple[str, str]] = []
        self.restored_before: list[int] = []  # turns this endpoint had when each restore came

    async def save_conversation(self, agent_key: str) -> str | None:
        name = f"{self.name}-{len(self.saved)}"  # a name per save, as a slot's would be
        self.saved.append((agent_key, name))
        return name if self.saves else None

    async def restore_conversation(self, agent_key: str, name: str) -> bool:
        self.restored.append((agent_key, name))
        self.restored_before.append(self.calls)
        return self.restores


def _pair(**b: bool) -> tuple[asyncio.Event, Carrying, Carrying]:
    hold = asyncio.Event()
    return hold, Carrying("a", hold), Carrying("b", hold, **b)


async def _four_homed_on_a(pool: EndpointPool, hold: asyncio.Event) -> list[ModelResponse]:
    """Four agents whose conversations are on "a" in flight at once, factor 1: the third and
    fourth move to "b" for load (the bound is the floor, 2)."""
    tasks = await _route_held(pool, _homed_on(0, 4), cached_on="a")
    hold.set()
    return list(await asyncio.wait_for(asyncio.gather(*tasks), 30))  # type: ignore[arg-type]


async def _two_held_two_moving(pool: EndpointPool
                                ) -> tuple[list[asyncio.Task[object]], list[asyncio.Task[object]]]:
    """Two held turns of agents homed on "a" in flight (it is then at the bound), and two more
    sent without waiting for their routing: both move, each carry starting as it may."""
    keys = _homed_on(0, 4)
    held = await _route_held(pool, keys[:2], cached_on="a")
    moved: list[asyncio.Task[object]] = [asyncio.create_task(pool.complete(ModelRequest(
        model="m", messages=[{"role": "user", "content": k}], agent_key=k, cached_on="a")))
        for k in keys[2:]]
    return held, moved


async def test_a_load_move_saves_on_the_home_and_restores_where_the_turn_goes_first() -> None:
    hold, a, b = _pair()
    pool = EndpointPool([a, b], load_factor=1.0)
    replies = await _four_homed_on_a(pool, hold)
    moved = _homed_on(0, 4)[2:]
    assert [r.endpoint for r in replies] == ["a", "a", "b", "b"]
    assert [k for k, _ in a.saved] == moved and b.restored == a.saved  # what "a" named
    assert b.saved == [] and a.restored == []
    # each restore came before the moved turn reached "b"
    assert b.restored_before == [0, 1]
    assert pool.carries() == {"carried": 2, "not_carried": 0}
    assert pool.moves() == {"load": 2, "failover": 0}


async def test_one_file_per_server_slot_whoever_saves() -> None:
    assert carry_file("llamacpp://h:1", 0) == carry_file("llamacpp://h:1", 0)
    assert carry_file("llamacpp://h:1", 0) != carry_file("llamacpp://h:2", 0)
    assert carry_file("llamacpp://h:1", 0) != carry_file("llamacpp://h:1", 1)
    name = carry_file("x/../y", 3)
    assert name.startswith("agentbatch-carry-") and "/" not in name


async def test_carries_to_one_target_run_at_once_each_with_its_own_file() -> None:
    # two moves in flight to "b" together: neither waits for the other, and each restore
    # reads the file its own save wrote
    hold, a, b = _pair()
    saving: list[str] = []
    both_saving = asyncio.Event()

    async def save(agent_key: str) -> str | None:
        saving.append(agent_key)
        if len(saving) == 2:
            both_saving.set()
        await asyncio.wait_for(both_saving.wait(), 5)  # times out if carries ran one by one
        return await Carrying.save_conversation(a, agent_key)

    a.save_conversation = save  # type: ignore[method-assign]
    pool = EndpointPool([a, b], load_factor=1.0)
    held, moved = await _two_held_two_moving(pool)
    hold.set()
    replies = await asyncio.wait_for(asyncio.gather(*held, *moved), 30)
    await pool.aclose()
    assert [r.endpoint for r in replies] == ["a", "a", "b", "b"]  # type: ignore[attr-defined]
    assert len({name for _, name in a.saved}) == 2 and sorted(b.restored) == sorted(a.saved)
    assert pool.carries() == {"carried": 2, "not_carried": 0}


async def test_a_pair_that_cannot_restore_what_was_saved_is_not_tried_again() -> None:
    # "b" does not read "a"'s save directory: the first move saves and fails to restore; the
    # second moves without a save (a save is a write of the whole conversation)
    hold, a, b = _pair(restores=False)
    pool = EndpointPool([a, b], load_factor=1.0)
    replies = await _four_homed_on_a(pool, hold)
    assert [r.endpoint for r in replies] == ["a", "a", "b", "b"]
    assert len(a.saved) == 1 and len(b.restored) == 1
    assert pool.carries() == {"carried": 0, "not_carried": 1}


async def test_a_home_that_saves_nothing_is_asked_each_move_and_nothing_is_restored() -> None:
    # not held there (another agent's turn took its slot), or not supported: no restore, and
    # nothing counted (nothing was tried on the servers)
    hold, a, b = _pair()
    a.saves = False
    pool = EndpointPool([a, b], load_factor=1.0)
    await _four_homed_on_a(pool, hold)
    assert len(a.saved) == 2 and b.restored == []
    assert pool.carries() == {"carried": 0, "not_carried": 0}


async def test_a_failover_move_carries_nothing() -> None:
    # the home failed: nothing can be read from it
    a = Carrying("a", asyncio.Event())
    a.script.append(BackendUnavailable("refused"))
    a.hold = None
    b = Carrying("b", asyncio.Event())
    b.hold = None
    pool = EndpointPool([a, b], eject_after=1)
    key = _homed_on(0, 1)[0]
    request = ModelRequest(model="m", messages=[{"role": "user", "content": key}],
                           agent_key=key, cached_on="a")
    try:
        with contextlib.suppress(BackendUnavailable):
            await pool.complete(request)  # the home refuses: ejected
        reply = await pool.complete(request)
    finally:
        await pool.aclose()
    assert reply.endpoint == "b" and pool.moves()["failover"] == 1
    assert a.saved == [] and b.restored == []


async def test_a_carry_that_hangs_is_given_up_and_the_turn_goes_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import agentbatch.backends.pool as pool_module

    monkeypatch.setattr(pool_module, "CARRY_TIMEOUT_S", 0.05)
    hold, a, b = _pair()
    never = asyncio.Event()

    async def stuck(agent_key: str) -> str | None:
        await never.wait()
        return "never"

    a.save_conversation = stuck  # type: ignore[method-assign]
    pool = EndpointPool([a, b], load_factor=1.0)
    held, moved = await _two_held_two_moving(pool)
    while pool.moves()["load"] < 2:  # both routed off "a" (the carries then hang)
        await asyncio.sleep(0)
    hold.set()
    replies = await asyncio.wait_for(asyncio.gather(*held, *moved), 30)
    assert [r.endpoint for r in replies] == ["a", "a", "b", "b"]  # type: ignore[attr-defined]
    assert b.restored == [] and pool.carries() == {"carried": 0, "not_carried": 0}
