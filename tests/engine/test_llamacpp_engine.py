"""The ``llamacpp://`` backend against the real engine: llama-server with SmolLM2-135M.

Structured output on both engines, backpressure read from llama.cpp's own queue gauge, batch
prompting that keeps the schema, and the prefix cache at work, all taken from the server's own
``/metrics``. The ``llama_server`` fixture (tests/engine/conftest.py) builds and starts it.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.request
from typing import Any

import pytest

from agentbatch import submit_batch
from agentbatch.backends.prom import metric_sum, parse_prometheus
from tests.engine.reviews import REVIEWS, TASK, Verdict, inputs

pytestmark = pytest.mark.engine

WORKER_ENV = {"AGENTBATCH_WORKER_IMPORTS": "tests.support,tests.engine"}
MODEL = "smollm2"

# A shared system prompt of a few hundred tokens: the prefix every agent's request starts with.
SYSTEM = (
    "You label short product reviews for a shop. Read the review, decide whether the "
    "customer was happy, and give a very short reason in plain words. " * 12
).strip()


def scrape(http_url: str) -> dict[str, float]:
    """The llama.cpp counters and gauges these tests read, from its ``/metrics``."""
    with urllib.request.urlopen(f"{http_url}/metrics", timeout=30) as resp:
        samples = parse_prometheus(resp.read().decode())
    names = ("prompt_tokens_total", "prompt_tokens_cached_total", "requests_processing",
             "requests_deferred")
    return {n: metric_sum(samples, f"llamacpp:{n}") or 0.0 for n in names}


class QueueSampler:
    """Reads ``llamacpp:requests_deferred`` every ``interval_s`` in a thread; keeps the max."""

    def __init__(self, http_url: str, interval_s: float = 0.2) -> None:
        self.http_url = http_url
        self.interval_s = interval_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            with contextlib.suppress(OSError):
                self.samples.append(scrape(self.http_url)["requests_deferred"])

    def __enter__(self) -> QueueSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


def test_structured_output_embedded(llama_server: Any) -> None:
    results = submit_batch(TASK, inputs(12), model=MODEL, backend=llama_server.llamacpp_url,
                           system_prompt=SYSTEM, output_schema=Verdict, max_tokens=64,
                           temperature=0.0).wait(timeout=600)
    valid = [r for r in results if r.ok and isinstance(r.output, Verdict)]
    assert len(valid) == len(results), [r.error for r in results if not r.ok][:3]


@pytest.mark.redis
def test_structured_output_distributed(
        llama_server: Any, redis_url: str, start_workers: Any) -> None:
    start_workers(1, concurrency=4, env=WORKER_ENV)
    handle = submit_batch(TASK, inputs(8), model=MODEL, backend=llama_server.llamacpp_url,
                          system_prompt=SYSTEM, output_schema=Verdict, max_tokens=64,
                          temperature=0.0, redis_url=redis_url)
    results = handle.wait(timeout=600)
    assert all(r.ok and isinstance(r.output, Verdict) for r in results), (
        [r.error for r in results if not r.ok][:3])


def test_backpressure_follows_llamacpp_deferred_gauge(llama_server: Any) -> None:
    """A batch that fills llama.cpp's slots makes it defer requests; a second batch with
    ``max_server_waiting=0`` holds its turns until the deferred gauge drops, then finishes."""
    with QueueSampler(llama_server.http_url) as sampler:
        # max_inflight above the slot count, or agentbatch would queue the extra turns itself
        filler = submit_batch(TASK, inputs(16), model=MODEL, backend=llama_server.llamacpp_url,
                              system_prompt=SYSTEM, output_schema=Verdict, max_tokens=64,
                              temperature=0.0, max_inflight=16)
        deadline = time.monotonic() + 120
        while not any(sampler.samples) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert any(sampler.samples), "llama.cpp never deferred a request of the filler batch"
        held = submit_batch(TASK, inputs(4), model=MODEL, backend=llama_server.llamacpp_url,
                            system_prompt=SYSTEM, output_schema=Verdict, max_tokens=64,
                            temperature=0.0, max_server_waiting=0, timeout_per_turn=600)
        results = held.wait(timeout=900) + filler.wait(timeout=900)
    stats = held.engine.gate.stats()
    print(f"gate {stats}; llama.cpp requests_deferred max seen {max(sampler.samples)}")
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    assert stats["holds"] > 0  # the gate closed on llama.cpp's deferred gauge ...
    assert stats["last_waiting"] == 0  # ... and opened once it drained


def test_turns_past_the_slot_count_wait_in_agentbatch_not_in_llamacpp(
        llama_server: Any) -> None:
    """By default the embedded engine keeps at most ``total_slots`` turns in flight, so
    llama.cpp defers nothing and agentbatch's near-done-first order picks the next turn."""
    with QueueSampler(llama_server.http_url) as sampler:
        results = submit_batch(TASK, inputs(16), model=MODEL,
                               backend=llama_server.llamacpp_url, system_prompt=SYSTEM,
                               output_schema=Verdict, max_tokens=64,
                               temperature=0.0).wait(timeout=600)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    assert len(sampler.samples) > 10 and max(sampler.samples) == 0


def _chat(url: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    body = {"model": MODEL, "messages": messages, "max_tokens": 16, "temperature": 0.0}
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def test_an_agents_next_turn_is_served_from_the_prompt_cache_after_others_ran(
        llama_server: Any) -> None:
    """``LlamaServer`` starts llama-server with ``--slot-prompt-similarity 0``: every slot
    reuse saves the slot's conversation to llama.cpp's host-memory prompt cache, so an agent's
    second turn finds its first turn there even after other agents used every slot. (With the
    default similarity selection only the shared system prompt was found.)"""
    url = llama_server.http_url
    first = [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": TASK.format(i=9001, text=REVIEWS[0])}]
    reply = _chat(url, first)
    first_prompt = reply["usage"]["prompt_tokens"]
    for i in range(2 * llama_server.parallel):  # other agents take every slot, twice over
        _chat(url, [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": TASK.format(i=9100 + i, text=REVIEWS[1])}])
    second = [*first, {"role": "assistant",
                       "content": reply["choices"][0]["message"]["content"]},
              {"role": "user", "content": "Reply again, shorter."}]
    usage = _chat(url, second)["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    print(f"second turn: {cached} of {usage['prompt_tokens']} prompt tokens cached; the first "
          f"turn's prompt was {first_prompt}")
    assert cached >= first_prompt


def test_batch_prompting_keeps_the_schema(llama_server: Any) -> None:
    n = 20
    # A batched request answers when its last prompt does; on a busy 2-core machine that can
    # take minutes, and this test is about validity, not the turn timeout.
    handle = submit_batch(TASK, inputs(n), model=MODEL, backend=llama_server.llamacpp_url,
                          system_prompt=SYSTEM, output_schema=Verdict, max_tokens=64,
                          temperature=0.0, batch_prompting=True, max_retries=0,
                          timeout_per_turn=900)
    started = time.monotonic()
    results = handle.wait(timeout=900)
    wall = time.monotonic() - started
    valid = sum(1 for r in results if r.ok and isinstance(r.output, Verdict))
    sent = handle.stats()["requests_sent"]
    print(f"batch prompting: {valid}/{n} valid, {sent} requests, {wall:.1f}s")
    assert valid >= 0.95 * n, [r.error for r in results if not r.ok][:3]
    assert sent < n  # prompts did travel together


def test_prefix_cache_counters_rise_across_a_batch(llama_server: Any) -> None:
    before = scrape(llama_server.http_url)
    results = submit_batch(TASK, inputs(12), model=MODEL, backend=llama_server.llamacpp_url,
                           system_prompt=SYSTEM, output_schema=Verdict, max_tokens=64,
                           temperature=0.0).wait(timeout=600)
    after = scrape(llama_server.http_url)
    assert all(r.ok for r in results)
    cached = after["prompt_tokens_cached_total"] - before["prompt_tokens_cached_total"]
    computed = after["prompt_tokens_total"] - before["prompt_tokens_total"]
    print(f"prompt tokens: {cached:.0f} cached, {computed:.0f} computed")
    assert cached > 0
    # The shared system prompt is most of each prompt: most tokens come from the cache.
    assert cached > computed
