"""BackpressureGate over a fake backend whose server load the test scripts (injected clock)."""

from __future__ import annotations

import asyncio

import pytest

from agentbatch.backends.base import Backend, ServerLoad
from agentbatch.core.model_io import ModelRequest, ModelResponse
from agentbatch.turnloop.backpressure import BackpressureGate


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds
        await asyncio.sleep(0)


class ScriptedLoad:
    """Each ``fetch_load`` returns the next scripted load (the last one repeats)."""

    def __init__(self, *loads: ServerLoad | BaseException | None,
                 gate: asyncio.Event | None = None) -> None:
        self.loads = list(loads)
        self.calls = 0
        self.concurrent = 0
        self.max_concurrent = 0
        self.gate = gate

    async def fetch_load(self) -> ServerLoad | None:
        self.calls += 1
        self.concurrent += 1
        self.max_concurrent = max(self.max_concurrent, self.concurrent)
        try:
            if self.gate is not None:
                await self.gate.wait()
            load = self.loads[min(self.calls, len(self.loads)) - 1]
        finally:
            self.concurrent -= 1
        if isinstance(load, BaseException):
            raise load
        return load


def waiting(n: float) -> ServerLoad:
    return ServerLoad(running=32, waiting=n)


def gate_for(backend: object, clock: Clock, **kw: float) -> BackpressureGate:
    kw.setdefault("max_waiting", 5)
    return BackpressureGate(backend, interval_s=0.5, clock=clock, sleep=clock.sleep, **kw)


async def test_a_short_queue_never_blocks_and_the_load_is_cached() -> None:
    clock = Clock()
    backend = ScriptedLoad(waiting(5))
    gate = gate_for(backend, clock, max_waiting=14)  # 5 waiting + 10 sent: 14 before the last
    for _ in range(10):
        await gate.wait_ready()
    assert backend.calls == 1 and clock.slept == []
    clock.now += 0.5
    await gate.wait_ready()
    assert backend.calls == 2
    assert gate.stats() == {"checks": 11, "holds": 0, "sleeps": 0, "fetches": 2,
                            "last_waiting": 5}


async def test_a_burst_is_held_at_max_waiting_plus_one_until_a_new_reading() -> None:
    """The first reading sees an empty queue; the calls admitted since count against it, so
    a burst of 10 lets 3 through with max_waiting=2 (the gauge alone let all 10 go)."""
    clock = Clock()
    release = asyncio.Event()

    async def sleep(seconds: float) -> None:
        await release.wait()
        await clock.sleep(seconds)

    backend = ScriptedLoad(waiting(0))
    gate = BackpressureGate(backend, max_waiting=2, interval_s=0.5, clock=clock, sleep=sleep)
    waiters = [asyncio.ensure_future(gate.wait_ready()) for _ in range(10)]
    for _ in range(5):
        await asyncio.sleep(0)
    assert sum(w.done() for w in waiters) == 3 and gate.unseen == 3
    assert gate.looks_open() is False
    release.set()  # time moves on: each new reading admits the next 3
    await asyncio.wait_for(asyncio.gather(*waiters), 30)
    assert backend.calls >= 4 and gate.unseen <= 3


async def test_a_long_queue_holds_until_it_drains() -> None:
    clock = Clock()
    backend = ScriptedLoad(waiting(40), waiting(12), waiting(3))
    gate = gate_for(backend, clock)
    await gate.wait_ready()
    assert clock.slept == [0.5, 0.5]
    assert backend.calls == 3
    assert gate.stats() == {"checks": 1, "holds": 1, "sleeps": 2, "fetches": 3,
                            "last_waiting": 3}


@pytest.mark.parametrize("load", [None, RuntimeError("metrics down")])
async def test_no_metrics_never_blocks(load: ServerLoad | BaseException | None) -> None:
    clock = Clock()
    backend = ScriptedLoad(load)
    gate = gate_for(backend, clock, max_waiting=0)
    await gate.wait_ready()
    assert clock.slept == [] and backend.calls == 1
    assert gate.stats()["last_waiting"] is None


async def test_a_backend_without_a_queue_gauge_never_holds() -> None:
    class NoGauge(Backend):  # the base class's ``fetch_load``: None, no server metrics
        async def complete(self, request: ModelRequest) -> ModelResponse:
            raise AssertionError("not called")

        async def aclose(self) -> None:
            return None

    clock = Clock()
    gate = gate_for(NoGauge(), clock, max_waiting=0)
    await gate.wait_ready()
    assert await gate.load() is None
    assert gate.stats()["holds"] == 0 and clock.slept == []


async def test_many_waiters_share_one_fetch_in_flight() -> None:
    clock = Clock()
    release = asyncio.Event()
    backend = ScriptedLoad(waiting(1), gate=release)
    gate = gate_for(backend, clock, max_waiting=100)  # room for all 50
    waiters = [asyncio.ensure_future(gate.wait_ready()) for _ in range(50)]
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert backend.calls == 1 and not any(w.done() for w in waiters)
    release.set()
    await asyncio.gather(*waiters)
    assert backend.calls == 1 and backend.max_concurrent == 1


async def test_held_waiters_recheck_together_with_one_fetch_per_interval() -> None:
    clock = Clock()
    backend = ScriptedLoad(waiting(50), waiting(50), waiting(0))
    gate = gate_for(backend, clock, max_waiting=20)  # the drained queue has room for all 20
    await asyncio.gather(*(gate.wait_ready() for _ in range(20)))
    # Each round of re-checks after a sleep shares one fetch: 3 fetches for 20 waiters.
    assert backend.calls == 3 and backend.max_concurrent == 1
    assert gate.stats()["holds"] == 20 and gate.stats()["sleeps"] == 40


async def test_a_cancelled_waiter_does_not_cancel_the_shared_fetch() -> None:
    clock = Clock()
    release = asyncio.Event()
    backend = ScriptedLoad(waiting(0), gate=release)
    gate = gate_for(backend, clock)
    first = asyncio.ensure_future(gate.wait_ready())
    second = asyncio.ensure_future(gate.wait_ready())
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    first.cancel()
    await asyncio.sleep(0)
    release.set()
    await second
    assert first.cancelled() and backend.calls == 1


def test_interval_must_be_positive() -> None:
    with pytest.raises(ValueError):
        BackpressureGate(object(), max_waiting=1, interval_s=0)
