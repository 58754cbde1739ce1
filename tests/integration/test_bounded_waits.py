"""Waits for capacity end: a server queue that never drains, or fleet slots that never free,
fail the turn at its deadline (``server_busy``), give way to ``cancel()``, and let a worker
stop on SIGTERM. Against a real HTTP server, real redis-server and real worker processes."""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator

import pytest
import redis
from aiohttp import web

from agentbatch import submit_batch
from agentbatch.distributed.state.keys import BatchKeys, semaphore
from tests.support.http_server import ThreadedServer

WORKER_ENV = {"AGENTBATCH_WORKER_IMPORTS": "tests.support"}
_REPLY = {
    "id": "c1", "object": "chat.completion", "created": 0, "model": "m",
    "choices": [{"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "done"}}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}


class BusyServer(ThreadedServer):
    """An OpenAI-compatible server whose ``/metrics`` always shows 1000 queued requests."""

    def __init__(self) -> None:
        super().__init__(name="busy-server")
        self.hits: Counter[str] = Counter()

    async def _chat(self, request: web.Request) -> web.Response:
        self.hits["chat"] += 1
        return web.json_response(_REPLY)

    async def _metrics(self, request: web.Request) -> web.Response:
        self.hits["metrics"] += 1
        return web.Response(text="vllm:num_requests_running 1\n"
                                 "vllm:num_requests_waiting 1000\n")

    async def _ok(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m"}]})

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._ok)
        app.router.add_get("/v1/models", self._ok)

    @property
    def backend(self) -> str:
        return f"vllm://127.0.0.1:{self.port}"


@pytest.fixture
def busy() -> Iterator[BusyServer]:
    with BusyServer() as server:
        yield server


def _until(check, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _batch(busy: BusyServer, n: int = 4, **kw):
    kw.setdefault("max_server_waiting", 0)
    return submit_batch("Agent {i}.", [{"i": i} for i in range(n)], model="m",
                        backend=busy.backend, warm_prefix=False, **kw)


def test_embedded_turn_held_by_a_full_server_queue_fails_at_its_deadline(busy):
    handle = _batch(busy, timeout_per_turn=2, max_retries=1)
    try:
        results = handle.wait(timeout=60)  # 2 attempts of 2 s each; never forever
    finally:
        handle.cancel()
    assert [r.error.kind if r.error else None for r in results] == ["server_busy"] * 4
    assert all("after 2 attempts" in r.error.message for r in results), results[0].error
    assert busy.hits["chat"] == 0 and busy.hits["metrics"] > 0


@pytest.mark.redis
def test_distributed_turn_held_by_a_full_server_queue_fails_at_its_deadline(
        busy, redis_url, start_workers):
    start_workers(1, concurrency=4, env=WORKER_ENV)
    handle = _batch(busy, timeout_per_turn=2, max_retries=0, redis_url=redis_url)
    try:
        results = handle.wait(timeout=90)
    finally:
        handle.cancel()
    assert [r.error.kind if r.error else None for r in results] == ["server_busy"] * 4
    assert busy.hits["chat"] == 0


@pytest.mark.redis
def test_distributed_cancel_ends_turns_held_by_the_gate(busy, redis_url, start_workers):
    start_workers(1, concurrency=4, env=WORKER_ENV)
    handle = _batch(busy, timeout_per_turn=600, max_retries=0, redis_url=redis_url)
    _until(lambda: busy.hits["metrics"] >= 3, "the worker to hold turns at the gate")
    handle.cancel()
    results = handle.wait(timeout=60)  # far below the 600 s turn deadline
    assert [r.error.kind if r.error else None for r in results] == ["cancelled"] * 4


def _fill_fleet_slots(redis_url: str, batch_id: str) -> None:
    """Take the batch's only fleet-wide inference slot for an hour, as a stuck holder would."""
    r = redis.from_url(redis_url, decode_responses=True)
    backends = json.loads(r.get(BatchKeys(batch_id).plan))["backends"]
    name = hashlib.sha1("|".join(backends).encode()).hexdigest()[:16]
    r.zadd(semaphore(name), {"stuck-holder": time.time() * 1000 + 3_600_000})


@pytest.mark.redis
def test_distributed_wait_for_a_fleet_slot_fails_at_its_deadline_and_obeys_cancel(
        busy, redis_url, start_workers):
    bounded = _batch(busy, timeout_per_turn=2, max_retries=0, max_server_waiting=None,
                     max_inflight=1, redis_url=redis_url)
    _fill_fleet_slots(redis_url, bounded.batch_id)
    start_workers(1, concurrency=4, env=WORKER_ENV)
    try:
        results = bounded.wait(timeout=90)
    finally:
        bounded.cancel()
    assert [r.error.kind if r.error else None for r in results] == ["server_busy"] * 4
    assert busy.hits["chat"] == 0

    held = _batch(busy, timeout_per_turn=600, max_retries=0, max_server_waiting=None,
                  max_inflight=1, redis_url=redis_url)
    r = redis.from_url(redis_url)
    leases = [BatchKeys(held.batch_id).lease(i) for i in range(4)]
    _until(lambda: r.exists(*leases) == 4, "every turn to be claimed and waiting for a slot")
    held.cancel()
    results = held.wait(timeout=60)
    assert [r.error.kind if r.error else None for r in results] == ["cancelled"] * 4
    assert busy.hits["chat"] == 0


@pytest.mark.redis
def test_worker_held_at_the_gate_exits_on_sigterm(busy, redis_url, start_workers):
    (worker,) = start_workers(1, concurrency=4, env=WORKER_ENV)
    handle = _batch(busy, timeout_per_turn=3, max_retries=1000, redis_url=redis_url)
    _until(lambda: busy.hits["metrics"] >= 3, "the worker to hold turns at the gate")
    assert worker.proc is not None
    worker.proc.send_signal(signal.SIGTERM)
    try:
        worker.proc.wait(60)  # each held turn ends by its 3 s deadline; never forever
    except subprocess.TimeoutExpired:
        pytest.fail(f"the worker did not exit on SIGTERM: {worker.log()[-2000:]}")
    finally:
        handle.cancel()
