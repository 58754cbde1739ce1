"""``pool_routing`` and ``pool_load_factor``: refused at submit where they cannot apply, carried
by the plan, and handed to the pool; the pool's move listeners (``add_move_listener``).

The routing tests drive an ``EndpointPool`` over scripted backends that hold every request
until released, so the load each routing decision sees is set by the test, not a scheduler.
"""

from __future__ import annotations

import asyncio
import typing
from pathlib import Path

import pytest

from agentbatch import run_batch
from agentbatch.backends.affinity import rank
from agentbatch.backends.base import BackendWrapper
from agentbatch.backends.pool import ROUTINGS, EndpointPool
from agentbatch.backends.pool_moves import count_moves
from agentbatch.backends.setup import open_backend
from agentbatch.core.errors import BatchSpecError
from agentbatch.core.model_io import ModelRequest
from agentbatch.core.options import DEFAULT_POOL_LOAD_FACTOR, BatchOptions, PoolRouting
from agentbatch.core.plan import BatchPlan
from agentbatch.turnloop.compile import compile_batch
from tests.support.fake_backend import ScriptedBackend

A, B = "sim://127.0.0.1:8000", "sim://127.0.0.1:8001"


def _refused(match: str, **options: object) -> None:
    with pytest.raises(BatchSpecError, match=match):
        run_batch("t {x}", [{"x": 1}], model="m", **{"backend": [A, B], **options})


def test_routing_literal_and_the_pools_routings_agree() -> None:
    assert typing.get_args(PoolRouting) == ROUTINGS == ("affinity", "least_outstanding")
    assert EndpointPool([ScriptedBackend()]).load_factor == DEFAULT_POOL_LOAD_FACTOR


@pytest.mark.parametrize("value", ["random", "", None, 1])
def test_unknown_routing_is_refused_naming_the_option(value: object) -> None:
    _refused("pool_routing must be one of 'affinity', 'least_outstanding'", pool_routing=value)


@pytest.mark.parametrize("value", [0.5, 0, -1, float("nan"), float("inf"), True, "2", None])
def test_bad_load_factor_is_refused_naming_the_option(value: object) -> None:
    _refused("pool_load_factor must be a finite number >= 1", pool_load_factor=value)


def test_pool_options_on_one_endpoint_are_refused(tmp_path: Path) -> None:
    _refused(r"pool_routing cannot apply to backend 'sim://127.0.0.1:8000'.*>= 2 endpoints",
             backend=A, pool_routing="least_outstanding")
    _refused(r"pool_load_factor cannot apply to backend 'sim://127.0.0.1:8000'",
             backend=[A], pool_load_factor=2.0)
    one = tmp_path / "one"  # a hostfile counts as the endpoints it lists
    one.write_text("127.0.0.1:8000\n")
    _refused("pool_routing cannot apply", backend="@" + str(one),
             pool_routing="least_outstanding")


def test_load_factor_with_least_outstanding_is_refused() -> None:
    _refused('pool_load_factor cannot apply with pool_routing="least_outstanding"',
             pool_routing="least_outstanding", pool_load_factor=3.0)


def test_defaults_apply_anywhere_and_the_plan_carries_both(tmp_path: Path) -> None:
    plain = compile_batch(BatchOptions(task="t {x}", inputs=[{"x": 1}], model="m",
                                       backend=A)).plan
    assert (plain.pool_routing, plain.pool_load_factor) == ("affinity", DEFAULT_POOL_LOAD_FACTOR)
    two = tmp_path / "two"
    two.write_text("127.0.0.1:8000\n127.0.0.1:8001\n")
    for backend, chosen in (([A, B], {"pool_routing": "least_outstanding"}),
                            ("@" + str(two), {"pool_load_factor": 2}),
                            ([A, B], {"pool_load_factor": 1.0})):
        opts = BatchOptions(task="t {x}", inputs=[{"x": 1}], model="m", backend=backend,
                            **chosen)  # type: ignore[arg-type]
        plan = BatchPlan.model_validate_json(compile_batch(opts).plan.model_dump_json())
        assert {name: getattr(plan, name) for name in chosen} == chosen


def _pool(backend: object) -> EndpointPool:
    while isinstance(backend, BackendWrapper):
        backend = backend.inner
    assert isinstance(backend, EndpointPool)
    return backend


def test_open_backend_hands_the_options_to_the_pool() -> None:
    pool = _pool(open_backend([A, B], pool_routing="least_outstanding"))
    assert pool.routing == "least_outstanding"
    pool = _pool(open_backend([A, B], pool_load_factor=3.0))
    assert (pool.routing, pool.load_factor) == ("affinity", 3.0)


# --- what the pool decides ----------------------------------------------------------------


def _homed_on(index: int, names: list[str], n: int) -> list[str]:
    """``n`` agent keys whose home (first choice) is endpoint ``index``."""
    keys = (f"agent-{i}" for i in range(10_000))
    return [k for k in keys if rank(k, names)[0] == index][:n]


async def _route_held(pool: EndpointPool, keys: list[str],
                      cached_on: str | None = None) -> list[asyncio.Task[object]]:
    """Send one held turn per key (their conversations on ``cached_on``), each routed after
    the previous one is in flight."""
    tasks: list[asyncio.Task[object]] = []
    for n, key in enumerate(keys, 1):
        tasks.append(asyncio.create_task(pool.complete(
            ModelRequest(model="m", messages=[{"role": "user", "content": key}],
                         agent_key=key, cached_on=cached_on))))
        for _ in range(100):  # routed and counted in flight before the next one
            if sum(s["outstanding"] for s in pool.stats().values()) == n:  # type: ignore[misc]
                break
            await asyncio.sleep(0)
        else:
            raise AssertionError(f"turn {n} never got in flight: {pool.stats()}")
    return tasks


@pytest.mark.parametrize(("factor", "served", "moves"),
                         [(1.0, [2, 2], ["load", "load"]), (3.0, [4, 0], [])])
async def test_load_factor_decides_when_a_turn_leaves_home(
        factor: float, served: list[int], moves: list[str]) -> None:
    # four agents whose conversations are on "a", all in flight: with factor 1 the home's
    # bound is 2 (the floor), so the third and fourth move; with factor 3 it is 5 and 6, so
    # none does
    hold = asyncio.Event()
    backends = [ScriptedBackend(name="a", hold=hold), ScriptedBackend(name="b", hold=hold)]
    pool = EndpointPool(list(backends), load_factor=factor)
    heard: list[str] = []
    pool.add_move_listener(heard.append)
    pool.add_move_listener(heard.append)  # added once however often given
    tasks = await _route_held(pool, _homed_on(0, ["a", "b"], 4), cached_on="a")
    hold.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert [b.calls for b in backends] == served
    assert heard == moves
    assert pool.moves() == {"load": len(moves), "failover": 0}


async def test_least_outstanding_ignores_the_agents_home() -> None:
    hold = asyncio.Event()
    backends = [ScriptedBackend(name="a", hold=hold), ScriptedBackend(name="b", hold=hold)]
    pool = EndpointPool(list(backends), routing="least_outstanding")
    tasks = await _route_held(pool, _homed_on(0, ["a", "b"], 4), cached_on="a")
    hold.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert [b.calls for b in backends] == [2, 2]
    assert pool.moves() == {"load": 0, "failover": 0}  # no home, so nothing moved


async def test_count_moves_listens_once_per_pool_and_per_callback() -> None:
    hold = asyncio.Event()
    backends = [ScriptedBackend(name="a", hold=hold), ScriptedBackend(name="b", hold=hold)]
    pool = EndpointPool(list(backends), load_factor=1.0)
    seen: list[tuple[str, int]] = []

    def on_move(reason: str, n: int) -> None:
        seen.append((reason, n))

    assert count_moves(pool, on_move) and count_moves(pool, on_move) and count_moves(pool)
    assert not count_moves(ScriptedBackend())
    assert len(pool._move_listeners) == 2  # Prometheus's, and on_move's, each once
    tasks = await _route_held(pool, _homed_on(0, ["a", "b"], 3), cached_on="a")
    hold.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert seen == [("load", 1)]
