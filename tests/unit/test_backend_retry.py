"""RetryingBackend: what is retried, how long it waits (recorded, never slept), what surfaces."""

from __future__ import annotations

import asyncio
import random

import pytest

from agentbatch.backends.base import Backend, BackendCapabilities
from agentbatch.backends.retry import RetryingBackend, RetryPolicy
from agentbatch.core.errors import (
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    BadRequest,
    RateLimited,
    ServerError,
)
from agentbatch.core.model_io import ModelRequest
from tests.support import fake_backend

REQUEST = ModelRequest(model="m", messages=[{"role": "user", "content": "hi"}])


class ScriptedBackend(fake_backend.ScriptedBackend):
    """Raises the scripted errors in order, then answers; counts calls."""

    def __init__(self, *script: BackendError) -> None:
        super().__init__(*script, capabilities=BackendCapabilities(
            prefix_warming=True, max_safe_concurrency=7))


class SleepRecorder:
    def __init__(self) -> None:
        self.waits: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.waits.append(seconds)
        await asyncio.sleep(0)  # yield, as a real sleep would, so concurrent calls interleave


def wrap(inner: ScriptedBackend, policy: RetryPolicy | None = None, seed: int = 0):
    sleep = SleepRecorder()
    return RetryingBackend(inner, policy, sleep=sleep, rng=random.Random(seed)), sleep


@pytest.mark.parametrize(
    "error",
    [
        RateLimited("429"),
        ServerError("500", status=500),
        BackendUnavailable("refused"),
        BackendTimeout("slow"),
    ],
)
async def test_transient_errors_are_retried(error: BackendError) -> None:
    inner = ScriptedBackend(error, error)
    backend, sleep = wrap(inner)
    resp = await backend.complete(REQUEST)
    assert resp.text == "ok"
    assert inner.calls == 3
    assert backend.retries == 2
    assert backend.retries_by_kind == {error.kind: 2}
    assert len(sleep.waits) == 2


async def test_bad_request_is_not_retried() -> None:
    error = BadRequest("nope", status=400)
    inner = ScriptedBackend(error)
    backend, sleep = wrap(inner)
    with pytest.raises(BadRequest) as info:
        await backend.complete(REQUEST)
    assert info.value is error
    assert inner.calls == 1 and backend.retries == 0 and sleep.waits == []


async def test_last_error_is_reraised_not_tenacity_retry_error() -> None:
    errors = [ServerError(f"boom {i}", status=502) for i in range(10)]
    inner = ScriptedBackend(*errors)
    backend, sleep = wrap(inner, RetryPolicy(attempts=4))
    with pytest.raises(ServerError) as info:
        await backend.complete(REQUEST)
    assert info.value is errors[3]
    assert inner.calls == 4
    assert backend.retries == 3 and len(sleep.waits) == 3


async def test_single_attempt_policy_never_retries() -> None:
    inner = ScriptedBackend(ServerError("x"))
    backend, _ = wrap(inner, RetryPolicy(attempts=1))
    with pytest.raises(ServerError):
        await backend.complete(REQUEST)
    assert inner.calls == 1 and backend.retries == 0


async def test_full_jitter_keeps_early_waits_well_under_a_second() -> None:
    for seed in range(20):
        inner = ScriptedBackend(*(ServerError("x") for _ in range(3)))
        backend, sleep = wrap(inner, seed=seed)
        await backend.complete(REQUEST)
        ceilings = [0.05, 0.1, 0.2]
        assert all(0.0 <= w <= c for w, c in zip(sleep.waits, ceilings, strict=True))


def test_backoff_without_jitter_is_capped_exponential() -> None:
    policy = RetryPolicy(initial=0.05, maximum=0.3, jitter=False)
    assert [policy.backoff(n) for n in range(1, 6)] == [0.05, 0.1, 0.2, 0.3, 0.3]


async def test_retry_after_is_a_lower_bound_on_the_wait() -> None:
    inner = ScriptedBackend(RateLimited("slow down", status=429, retry_after=2.5))
    backend, sleep = wrap(inner)
    await backend.complete(REQUEST)
    assert sleep.waits == [2.5]


async def test_retry_after_is_capped() -> None:
    inner = ScriptedBackend(RateLimited("slow down", retry_after=3600.0))
    backend, sleep = wrap(inner, RetryPolicy(max_retry_after=30.0))
    await backend.complete(REQUEST)
    assert sleep.waits == [30.0]


async def test_retry_after_can_be_ignored() -> None:
    inner = ScriptedBackend(RateLimited("slow down", retry_after=10.0))
    backend, sleep = wrap(inner, RetryPolicy(honour_retry_after=False))
    await backend.complete(REQUEST)
    assert sleep.waits[0] <= 0.05


async def test_backoff_larger_than_retry_after_wins() -> None:
    policy = RetryPolicy(initial=1.0, jitter=False)
    assert policy.wait_for(3, RateLimited("x", retry_after=0.5)) == 4.0


async def test_concurrent_calls_keep_independent_retry_state() -> None:
    inner = ScriptedBackend(*(ServerError("x") for _ in range(4)))
    backend, _ = wrap(inner, RetryPolicy(attempts=10))
    results = await asyncio.gather(*(backend.complete(REQUEST) for _ in range(4)))
    assert [r.text for r in results] == ["ok"] * 4
    assert inner.calls == 8 and backend.retries == 4


async def test_delegation_and_protocol() -> None:
    inner = ScriptedBackend()
    backend, _ = wrap(inner)
    assert isinstance(backend, Backend)
    assert backend.name == "scripted"
    assert backend.capabilities.max_safe_concurrency == 7
    assert backend.inner is inner
    await backend.warm(REQUEST)  # a declared hook: forwarded by BackendWrapper
    assert len(inner.warmed) == 1
    with pytest.raises(AttributeError):
        _ = backend.script  # not a hook: no pass-through of the inner's attributes
    await backend.aclose()
    assert inner.closed


def test_policy_validation() -> None:
    with pytest.raises(ValueError):
        RetryPolicy(attempts=0)
    with pytest.raises(ValueError):
        RetryPolicy(initial=-1)
