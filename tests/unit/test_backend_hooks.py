"""Every hook ``Backend`` declares is overridden by the drivers meant to have it, and called
where it is meant to be (a recording vLLM driver over real HTTP against the simulator, on the
embedded engine, the endpoint pool and real worker processes): a renamed hook fails here
instead of silently switching a feature off."""

from __future__ import annotations

import asyncio
import importlib
import os
import socket
import time
from pathlib import Path

import pytest

from agentbatch import submit_batch
from agentbatch.backends import registry
from agentbatch.backends.aimd import AdaptiveBackend
from agentbatch.backends.base import Backend, BackendWrapper
from agentbatch.backends.llamacpp import LlamaCppBackend
from agentbatch.backends.microbatch import MicroBatchingBackend
from agentbatch.backends.pool import EndpointPool
from agentbatch.backends.retry import RetryingBackend
from agentbatch.backends.setup import open_backend
from agentbatch.backends.vllm import VLLMBackend
from agentbatch.core.errors import BackendUnavailable, RateLimited
from agentbatch.core.model_io import ModelRequest
from tests.support.hook_recorder import (
    DRIVER,
    LOG_ENV,
    REGISTER_ENV,
    Answer,
    RecordingBackend,
    recorded,
)

HOOKS = {"preflight", "warm", "fetch_load", "inflight_hint", "learn_inflight_hint",
         "complete_batch", "batch_limit", "health", "listeners", "requests_sent", "retries",
         "context_length", "count_tokens", "save_conversation", "restore_conversation",
         "pinned_slots", "share_slots"}
DEADLINE_S = 60.0


def declared_hooks() -> set[str]:
    required = {"complete", "aclose"}
    return {name for name, value in vars(Backend).items()
            if not name.startswith("_") and name not in required
            and (callable(value) or isinstance(value, property))}


def overridden(cls: type) -> set[str]:
    return {hook for hook in HOOKS if getattr(cls, hook) is not getattr(Backend, hook)}


def test_the_declared_hooks_are_the_ones_tested_here() -> None:
    assert declared_hooks() == HOOKS


@pytest.mark.parametrize(("cls", "hooks"), [
    (LlamaCppBackend, HOOKS - {"listeners", "retries"}),
    (VLLMBackend, {"preflight", "warm", "fetch_load", "complete_batch", "health",
                   "requests_sent", "context_length", "count_tokens"}),
    (EndpointPool, {"warm", "fetch_load", "complete_batch", "health", "context_length",
                    "count_tokens"}),
    (BackendWrapper, HOOKS),  # forwards each to the inner backend, by name
    (RetryingBackend, HOOKS),
    (RecordingBackend, HOOKS),  # so the tests below can see every hook
])
def test_each_backend_overrides_the_hooks_it_is_meant_to_have(cls: type,
                                                             hooks: set[str]) -> None:
    assert overridden(cls) == hooks


def test_every_driver_and_wrapper_inherits_backend_and_nothing_passes_through() -> None:
    for path in registry._DRIVERS.values():
        module, _, name = path.partition(":")
        assert issubclass(getattr(importlib.import_module(module), name), Backend), path
    for cls in (RetryingBackend, AdaptiveBackend, MicroBatchingBackend, EndpointPool):
        assert issubclass(cls, Backend)
    assert "__getattr__" not in vars(BackendWrapper)


@pytest.fixture
def hook_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where this process's (and its workers') hook calls are recorded; sim:// records."""
    log = tmp_path / "hooks.log"
    monkeypatch.setenv(LOG_ENV, str(log))
    monkeypatch.setitem(registry._DRIVERS, "sim", DRIVER)
    return log


def questions(n: int) -> list[dict[str, int]]:
    return [{"i": i} for i in range(n)]


def test_the_embedded_engine_calls_its_hooks(hook_log: Path, sim_url: str) -> None:
    handle = submit_batch("Question {i}.\n@sim answer reply-{i}\nThanks.", questions(20),
                          model="m", backend=sim_url, batch_prompting=True,
                          max_server_waiting=1000)
    results = handle.wait(timeout=DEADLINE_S)
    stats = handle.stats()
    assert [r.output for r in results] == [f"reply-{i}" for i in range(20)]
    # preflight (and its queue gauge check), warm-up (on a server that shares a prefix in
    # flight, as sim:// does, that is a health check), the in-flight cap, the gate's load,
    # batch prompting's limit and batched call, and stats; workers alone learn a hint, and
    # retries/listeners belong to the retry layer; each turn asks the context length
    # (learnt once), and prompts this short need no count.
    assert recorded(hook_log) == {"preflight", "warm", "health", "fetch_load",
                                  "inflight_hint", "batch_limit", "complete_batch",
                                  "requests_sent", "context_length"}
    assert isinstance(stats["requests_sent"], int) and stats["requests_sent"] < 20
    assert stats["retries"] == 0  # the retry layer's own count, not "unknown"


async def test_a_retried_error_reaches_the_listeners_and_the_retry_count(
        hook_log: Path, sim_url: str) -> None:
    backend = open_backend([sim_url])
    heard: list[BaseException] = []
    backend.listeners.append(heard.append)  # as a worker does for the fleet-wide AIMD
    request = ModelRequest(model="m", messages=[
        {"role": "user", "content": "Hi.\n@sim fail http_429 times=1\n@sim answer ok\nThanks."}])
    try:
        reply = await backend.complete(request)
    finally:
        await backend.aclose()
    assert reply.text == "ok"
    assert [type(e) for e in heard] == [RateLimited] and backend.retries == 1
    assert "listeners" not in recorded(hook_log)  # the retry layer's, not the driver's


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_the_pool_calls_its_endpoints_hooks(hook_log: Path, sim_url: str) -> None:
    dead_port = closed_port()
    dead = RecordingBackend(f"sim://127.0.0.1:{dead_port}")
    pool = EndpointPool([dead, RecordingBackend(sim_url)], eject_after=1, probe_interval_s=0.05)
    # an agent whose home (rendezvous hashing over the endpoints' random ports) is the dead one
    key = next(k for k in (f"agent{i}" for i in range(1000))
               if str(dead_port) in (pool.endpoint_for(k) or ""))
    request = ModelRequest(model="m", agent_key=key,
                           messages=[{"role": "user", "content": "@sim answer ok\nThanks."}])
    try:
        with pytest.raises(BackendUnavailable):
            await pool.complete(request)  # the first agent lands on the dead one: ejected
        deadline = time.monotonic() + DEADLINE_S
        while "health" not in recorded(hook_log):  # the probe asks it to come back
            assert time.monotonic() < deadline, "the ejected endpoint was never probed"
            await asyncio.sleep(0.05)
        await pool.warm(request)  # the live one warms: enough
        load = await pool.fetch_load()
        replies = await pool.complete_batch(["a", "b"], model="m")
    finally:
        await pool.aclose()
    assert load is not None and len(replies) == 2
    assert recorded(hook_log) == {"health", "warm", "fetch_load", "complete_batch"}


async def test_a_pool_moving_a_turn_for_load_carries_its_conversation(hook_log: Path,
                                                                       sim_url: str) -> None:
    pool = EndpointPool([RecordingBackend(sim_url), RecordingBackend(sim_url)], load_factor=1)
    home, other = pool.stats()  # the same URL twice: two endpoints, told apart by name
    request = ModelRequest(model="m", agent_key="agent0", cached_on=home,
                           messages=[{"role": "user", "content": "@sim answer ok\nThanks."}])
    pool._eps[0].outstanding = 5  # its home is past the load bound (floor 2) now
    try:
        reply = await pool.complete(request)
    finally:
        pool._eps[0].outstanding = 0
        await pool.aclose()
    assert reply.endpoint == other and pool.moves()["load"] == 1
    assert recorded(hook_log) == {"save_conversation", "restore_conversation"}


@pytest.mark.redis
@pytest.mark.slow
def test_workers_call_the_hooks_of_a_distributed_batch(hook_log: Path, sim_url: str,
                                                       redis_url: str, start_workers) -> None:
    start_workers(1, env={LOG_ENV: str(hook_log), REGISTER_ENV: "1"})
    task = 'Question {i}.\n@sim answer {{"summary": "reply-{i}"}}\nThanks.'
    handle = submit_batch(task, questions(12), model="m", backend=sim_url, redis_url=redis_url,
                          output_schema=Answer, batch_prompting=True, max_server_waiting=1000)
    results = handle.wait(timeout=3 * DEADLINE_S)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    mine, theirs = recorded(hook_log, by=os.getpid()), recorded(hook_log, not_by=os.getpid())
    # The submitter checks the server, asks whether it pins turns to slots, and warms it
    # (sim:// shares a prefix in flight, as vLLM does: its warm-up checks its health);
    # a worker learns the slot hint (no preflight ran there) and reads it for the fleet cap,
    # is handed the fleet's slot map for the endpoint the plan says pins, reads the load at
    # its gate and the batch limit as each turn enters a batching window. Whether two turns
    # share a window on a worker is timing, so complete_batch is not asserted here (it is
    # above).
    assert mine == {"preflight", "pinned_slots", "warm", "health", "fetch_load"}
    assert {"learn_inflight_hint", "inflight_hint", "share_slots", "fetch_load",
            "batch_limit"} <= theirs
