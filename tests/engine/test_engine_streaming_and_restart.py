"""Streaming and engine failure against the real engine: llama-server with SmolLM2-135M.

Two things the simulator cannot show truthfully: that ``?stream=1`` measures time-to-first-token
from llama.cpp's own SSE stream, and that a batch survives the engine process dying mid-batch
(SIGKILL, not a polite shutdown) and coming back on the same port, every agent retrying to ok.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import urllib.request
from collections import defaultdict
from typing import Any

import pytest

from agentbatch import AgentResult, submit_batch
from agentbatch.backends.openai_compat import OpenAICompatBackend
from agentbatch.backends.prom import metric_sum, parse_prometheus
from agentbatch.core.model_io import ModelRequest, ModelResponse
from agentbatch.embedded.handle import EmbeddedHandle
from agentbatch.engine import EnginePaths, LlamaServer
from agentbatch.engine.server import free_port
from agentbatch.turnloop.handle import BatchHandle
from tests.engine import reviews
from tests.engine.reviews import REVIEWS, TASK, Verdict

pytestmark = pytest.mark.engine

MODEL = "smollm2"
# Workers import the output schema from this module.
WORKER_ENV = {"AGENTBATCH_WORKER_IMPORTS": "tests.support,tests.engine"}
SYSTEM = ("You label short product reviews for a shop. Read the review, decide whether the "
          "customer was happy, and give a very short reason in plain words.")


def inputs(n: int) -> list[dict[str, object]]:
    return reviews.inputs(n, REVIEWS[:4])  # the first four reviews only, as this test had


def prompt_tokens_total(http_url: str) -> float:
    """Prompt tokens this llama-server process has computed (``/metrics``, since it started)."""
    with urllib.request.urlopen(f"{http_url}/metrics", timeout=30) as resp:
        samples = parse_prometheus(resp.read().decode())
    return metric_sum(samples, "llamacpp:prompt_tokens_total") or 0.0


def test_streaming_ttft_comes_from_the_real_stream(
        llama_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every streamed turn records a TTFT that is positive and shorter than the turn itself.

    The test records what the backend measured (``ModelResponse.ttft_s``) around the real
    streaming call, with that call's wall time. A TTFT strictly below the call's wall time
    shows the first token arrived while the rest of the reply was still streaming (a
    non-streamed reply would record nothing here). ``AgentResult.ttft_s`` is the first
    streamed turn's.
    """
    lock = threading.Lock()
    seen: dict[int, list[tuple[float | None, float]]] = defaultdict(list)
    original = OpenAICompatBackend._complete_streaming

    async def recording(self: OpenAICompatBackend, request: ModelRequest,
                        timeout: float) -> ModelResponse:
        started = time.monotonic()
        response = await original(self, request, timeout)
        wall = time.monotonic() - started
        with lock:
            seen[int(request.agent_key.rpartition(":")[2])].append((response.ttft_s, wall))
        return response

    monkeypatch.setattr(OpenAICompatBackend, "_complete_streaming", recording)
    n = 6
    results = submit_batch(TASK, inputs(n), model=MODEL,
                           backend=llama_server.llamacpp_url + "?stream=1",
                           system_prompt=SYSTEM, output_schema=Verdict, max_tokens=48,
                           temperature=0.0).wait(timeout=600)
    assert len(results) == n
    assert all(r.ok and isinstance(r.output, Verdict) for r in results), (
        [r.error for r in results if not r.ok][:3])
    for r in results:
        assert seen[r.index], f"agent {r.index}: no streamed turn recorded"
        ttft, wall = seen[r.index][-1]  # the turn that produced the final answer
        assert ttft is not None, f"agent {r.index}: the stream gave no TTFT"
        assert 0 < ttft < wall, (r.index, ttft, wall)
        assert r.latency_s is None or ttft < r.latency_s
        assert r.ttft_s == seen[r.index][0][0], (r.index, r.ttft_s, seen[r.index])
    ttfts = sorted(t for r in results for t, _ in seen[r.index] if t is not None)
    print(f"streamed TTFT over {len(ttfts)} turns: min {ttfts[0]:.3f}s max {ttfts[-1]:.3f}s")


def _kill_and_restart(server: LlamaServer, down_s: float) -> int:
    """SIGKILL the server process, leave it down ``down_s`` seconds, start it on its port.

    Returns how many requests the killed process had started in a slot and never finished,
    counted from its own log (``launch_slot_`` vs ``release:`` lines): requests that failed.
    """
    assert server.proc is not None and server.log_path is not None
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait(30)
    log = server.log_path.read_text(errors="replace")
    cut_off = log.count("launch_slot_:") - log.count("release:")
    server.stop()  # forget the dead process (and its log) so start() may spawn again
    time.sleep(down_s)  # agents' requests fail against a closed port meanwhile
    server.start()
    return cut_off


def _through_a_restart(server: LlamaServer, handle: BatchHandle,
                       n: int) -> tuple[dict[str, int], int, list[AgentResult]]:
    """Wait until the batch flows through the engine, kill and restart it, collect results.

    The trigger is the first delivered result: llama.cpp answers ``/metrics`` between decode
    steps, seconds late on a busy machine, so its gauges are too slow a trigger here.
    Returns the batch status just before the kill, the requests the kill cut off in the
    engine, and the results.
    """
    port = server.port
    try:
        deadline = time.monotonic() + 120
        while handle.status()["delivered"] < 1:
            assert time.monotonic() < deadline, "no agent finished before the kill"
            time.sleep(0.02)
        before = handle.status()
        cut_off = _kill_and_restart(server, down_s=2.0)
        assert server.port == port
        results = handle.wait(timeout=600)
    except BaseException:
        with contextlib.suppress(Exception):
            handle.cancel()
        raise
    assert len(results) == n
    assert all(r.ok and isinstance(r.output, Verdict) for r in results), (
        [r.error for r in results if not r.ok][:3])
    assert before["delivered"] < n  # the kill landed mid-batch ...
    assert cut_off > 0  # ... with requests in the engine's slots, which failed
    return before, cut_off, results


def _submit(server: LlamaServer, n: int, redis_url: str | None = None) -> BatchHandle:
    # max_retries covers the seconds the engine is down: failed attempts back off
    # exponentially (jittered, capped at 5 s), each one charged to the agent's budget.
    return submit_batch(TASK, inputs(n), model=MODEL, backend=server.llamacpp_url,
                        system_prompt=SYSTEM, output_schema=Verdict, max_tokens=64,
                        temperature=0.0, max_retries=30, timeout_per_turn=180,
                        redis_url=redis_url)


def test_killed_and_restarted_engine_mid_batch(engine_paths: EnginePaths) -> None:
    """SIGKILL llama-server while a batch is in flight, restart it on the same port: requests
    fail while it is down, the retry layer absorbs them, and every agent ends ok."""
    n = 16
    with LlamaServer(engine_paths, port=free_port(), parallel=2) as server:
        handle = _submit(server, n)
        before, cut_off, _ = _through_a_restart(server, handle, n)
        served_after = prompt_tokens_total(server.http_url)  # by the restarted process
    stats = handle.stats()
    backend = handle.engine.rt.backend if isinstance(handle, EmbeddedHandle) \
        and handle.engine is not None else None
    by_kind = dict(getattr(backend, "retries_by_kind", {}))
    print(f"status before the kill {before}; requests cut off {cut_off}; stats {stats}; "
          f"retries by kind {by_kind}; prompt tokens after the restart {served_after:.0f}")
    assert isinstance(stats["retries"], int) and stats["retries"] > 0  # requests did fail
    assert served_after > 0  # the agents left at the kill were answered by the new process


@pytest.mark.redis
def test_killed_and_restarted_engine_mid_batch_distributed(
        engine_paths: EnginePaths, redis_url: str, start_workers: Any) -> None:
    """The same on the distributed engine: a worker's requests fail while the engine is down,
    its retries carry every agent to ok once the engine is back on the same port.

    The distributed engine keeps no retry counter, so the evidence that requests failed is
    the killed engine's own log (requests started in a slot and never finished) and that the
    restarted process computed prompts for the agents still running.
    """
    n = 16
    start_workers(1, concurrency=4, env=WORKER_ENV)
    with LlamaServer(engine_paths, port=free_port(), parallel=2) as server:
        handle = _submit(server, n, redis_url=redis_url)
        before, cut_off, _ = _through_a_restart(server, handle, n)
        served_after = prompt_tokens_total(server.http_url)
    print(f"status before the kill {before}; requests cut off {cut_off}; "
          f"prompt tokens after the restart {served_after:.0f}")
    assert served_after > 0
