"""AIMD controller (fake clock), the resizable gate, and AdaptiveBackend over a fake backend."""

from __future__ import annotations

import asyncio

import pytest

from agentbatch.backends.aimd import AdaptiveBackend, AIMDController, ResizableGate
from agentbatch.backends.base import Backend, BackendCapabilities
from agentbatch.backends.retry import RetryingBackend, RetryPolicy
from agentbatch.core.errors import BadRequest, RateLimited, ServerError
from agentbatch.core.model_io import ModelRequest
from tests.support.fake_backend import ScriptedBackend


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_throttle_halves_once_per_cooldown() -> None:
    clock = Clock()
    heard: list[int] = []
    c = AIMDController(
        initial=32, minimum=1, maximum=64, cooldown_s=2.0, clock=clock, on_change=heard.append
    )
    assert c.on_throttle() is True
    assert c.limit == 16
    for _ in range(10):  # the rest of the same burst
        clock.now += 0.1
        assert c.on_throttle() is False
    assert c.limit == 16
    clock.now += 2.0  # past the cooldown (measured from the last *decrease*)
    assert c.on_throttle() is True
    assert c.limit == 8
    assert heard == [16, 8]
    assert (c.throttles, c.decreases) == (12, 2)


def test_limit_never_below_minimum() -> None:
    clock = Clock()
    c = AIMDController(initial=3, minimum=2, cooldown_s=0.0, clock=clock)
    for _ in range(5):
        c.on_throttle()
    assert c.limit == 2


def test_additive_increase_after_quiet_period() -> None:
    clock = Clock()
    c = AIMDController(initial=2, maximum=4, quiet_period_s=30.0, clock=clock)
    clock.now += 29.9
    assert c.on_success() is False and c.limit == 2
    clock.now += 0.1
    assert c.on_success() is True and c.limit == 3
    clock.now += 10  # the quiet timer restarted at the increase
    assert c.on_success() is False and c.limit == 3
    clock.now += 20
    assert c.on_success() is True and c.limit == 4
    clock.now += 60
    assert c.on_success() is False and c.limit == 4  # capped at maximum


def test_throttle_restarts_the_quiet_timer_even_inside_cooldown() -> None:
    clock = Clock()
    c = AIMDController(initial=8, quiet_period_s=30.0, cooldown_s=2.0, clock=clock)
    c.on_throttle()  # -> 4
    clock.now += 1.0
    c.on_throttle()  # ignored for the decrease, but the account is still throttling
    clock.now += 29.5  # 30.5 s after the first throttle, 29.5 s after the last
    assert c.on_success() is False
    clock.now += 0.5
    assert c.on_success() is True and c.limit == 5


def test_initial_is_clamped_and_bad_bounds_rejected() -> None:
    assert AIMDController(initial=500, maximum=64).limit == 64
    assert AIMDController(initial=0, minimum=1).limit == 1
    with pytest.raises(ValueError):
        AIMDController(minimum=5, maximum=4)


def test_listener_errors_are_contained() -> None:
    c = AIMDController(initial=8, clock=Clock())

    def bad(limit: int) -> None:
        raise RuntimeError("listener bug")

    heard: list[int] = []
    c.add_listener(bad)
    c.add_listener(heard.append)
    c.on_throttle()
    assert heard == [4]


async def test_gate_resizes_while_held() -> None:
    gate = ResizableGate(2)
    await gate.acquire()
    await gate.acquire()
    waiter = asyncio.create_task(gate.acquire())
    await asyncio.sleep(0)
    assert gate.waiting == 1 and gate.in_use == 2
    gate.set_capacity(3)  # growing admits the waiter at once
    await waiter
    assert gate.in_use == 3
    gate.set_capacity(1)  # shrinking evicts no one ...
    assert gate.in_use == 3
    gate.release()
    gate.release()
    late = asyncio.create_task(gate.acquire())
    await asyncio.sleep(0)
    assert not late.done()  # ... but holds new grants until in_use < capacity
    gate.release()
    await late
    assert gate.in_use == 1


async def test_gate_cancelled_waiter_does_not_leak_a_slot() -> None:
    gate = ResizableGate(1)
    await gate.acquire()
    waiter = asyncio.create_task(gate.acquire())
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    gate.release()
    assert gate.in_use == 0
    await gate.acquire()
    assert gate.in_use == 1


def scripted(outcomes: list[Exception | None], hold: asyncio.Event | None = None
             ) -> ScriptedBackend:
    """A fake backend: one outcome per call; counts concurrency."""
    return ScriptedBackend(*outcomes, name="fake", hold=hold, inflight_hint=5,
                           capabilities=BackendCapabilities(max_safe_concurrency=16))


REQ = ModelRequest(model="m", messages=[{"role": "user", "content": "hi"}])


async def test_adaptive_throttle_then_success_via_retrying_backend() -> None:
    clock = Clock()
    inner = scripted([RateLimited("429", status=429), RateLimited("429", status=429), None])
    controller = AIMDController(initial=8, clock=clock)
    adaptive = AdaptiveBackend(inner, controller)
    waits: list[float] = []

    async def sleep(s: float) -> None:
        waits.append(s)
        clock.now += 0.5  # retries inside one cooldown window

    backend = RetryingBackend(adaptive, RetryPolicy(attempts=4), sleep=sleep)
    assert isinstance(backend, Backend)
    resp = await backend.complete(REQ)
    assert resp.text == "ok"
    assert inner.calls == 3 and backend.retries == 2
    assert controller.throttles == 2 and controller.decreases == 1
    assert adaptive.limit == 4 and adaptive.gate.capacity == 4
    assert adaptive.gate.in_use == 0


async def test_adaptive_other_errors_neither_throttle_nor_succeed() -> None:
    clock = Clock()
    controller = AIMDController(initial=8, quiet_period_s=1.0, clock=clock)
    adaptive = AdaptiveBackend(
        scripted([BadRequest("400"), ServerError("500", status=500)]), controller
    )
    clock.now += 5
    for exc in (BadRequest, ServerError):
        with pytest.raises(exc):
            await adaptive.complete(REQ)
    assert controller.limit == 8 and controller.throttles == 0
    await adaptive.complete(REQ)  # a success after the quiet period grows the limit
    assert controller.limit == 9


async def test_adaptive_529_overloaded_counts_as_throttle() -> None:
    controller = AIMDController(initial=8, clock=Clock())
    adaptive = AdaptiveBackend(scripted([ServerError("overloaded", status=529)]), controller)
    with pytest.raises(ServerError):
        await adaptive.complete(REQ)
    assert controller.limit == 4


async def test_adaptive_gate_bounds_concurrency_and_delegates() -> None:
    hold = asyncio.Event()
    inner = scripted([], hold=hold)
    adaptive = AdaptiveBackend(inner, AIMDController(initial=3, clock=Clock()))
    tasks = [asyncio.create_task(adaptive.complete(REQ)) for _ in range(10)]
    for _ in range(5):
        await asyncio.sleep(0)
    assert inner.active == 3 and adaptive.gate.waiting == 7
    hold.set()
    await asyncio.gather(*tasks)
    assert inner.peak == 3 and inner.calls == 10
    assert adaptive.name == "fake" and adaptive.capabilities.max_safe_concurrency == 16
    assert adaptive.inflight_hint == 5
    await adaptive.aclose()
    assert inner.closed
