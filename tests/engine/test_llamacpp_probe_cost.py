"""What the warm-up cache probe costs a llama-server (issue 26 item 2).

On a pool of two llama-servers, agentbatch embedded computed more prompt tokens per agent
than a naive client pinning agents by hash (7634 vs 6204 for 3 agents x 7 turns), with no turn
moved between servers. The excess was the probe, run on every server of the pool: it sent
the shared prefix pinned to slot 0, then pinned to slot 1, and a request pinned with
``id_slot`` never restores from llama.cpp's host-memory prompt cache (``get_available_slot``
on this build restores only for a slot it chose itself), so every server computed the prefix
twice. The probe now sends a one-word prompt to slot 1: it still makes another slot work
between the two requests to slot 0 (which is what shows whether idle slots are cleared), and
the prefix is computed once per server. Asserted on the server's own prompt-token counter
around the probe, and on what the probe concluded; never on what the model wrote.
"""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator

import pytest

from agentbatch.backends.llamacpp import CacheProbe, LlamaCppBackend
from agentbatch.backends.prom import metric_sum, parse_prometheus
from agentbatch.core.model_io import ModelRequest
from agentbatch.engine import EnginePaths, LlamaServer

pytestmark = pytest.mark.engine

MODEL = "smollm2"
SYSTEM = ("You read a manual one page at a time and then summarise it in a few plain words "
          "for a technician who has never seen the pump before. " * 8).strip()
# The one-word prompt and the chat template's own tokens: far below a second prefix.
SLACK = 40


def prompt_tokens_total(http_url: str) -> float:
    """The server's own counter of prompt tokens it computed (``/metrics``)."""
    with urllib.request.urlopen(f"{http_url}/metrics", timeout=30) as resp:
        samples = parse_prometheus(resp.read().decode())
    return metric_sum(samples, "llamacpp:prompt_tokens_total") or 0.0


@pytest.fixture
def server(engine_paths: EnginePaths) -> Iterator[LlamaServer]:
    """A fresh server as ``agentbatch engine start`` starts it (two slots, nothing cached)."""
    with LlamaServer(engine_paths, parallel=2, threads=1) as s:
        yield s


async def _probe(url: str) -> CacheProbe | None:
    backend = LlamaCppBackend(url)
    try:
        return await backend.probe_cache(ModelRequest(
            model=MODEL, messages=[{"role": "system", "content": SYSTEM},
                                   {"role": "user", "content": "ok"}],
            max_tokens=1, agent_key="b:warmup"))
    finally:
        await backend.aclose()


def test_the_probe_computes_the_shared_prefix_once(server: LlamaServer) -> None:
    before = prompt_tokens_total(server.http_url)
    probe = asyncio.run(_probe(server.llamacpp_url))
    computed = prompt_tokens_total(server.http_url) - before
    print(f"probe {probe}; prompt tokens computed by the server {computed:.0f}")
    assert probe is not None and not probe.defeated and probe.pinning_keeps_prefix, probe
    assert computed <= probe.prompt_tokens + SLACK, (computed, probe)


def test_the_next_batchs_probe_computes_nothing_the_slots_already_hold(
        engine_paths: EnginePaths) -> None:
    """With nothing restored from host memory (``--cache-ram 0``) and least-recently-used slots
    (``--slot-prompt-similarity 0``), the first probe leaves the prefix in both slots: slot 0
    by its pinned requests, slot 1 by the server's own choice for the unpinned repeat. The
    next batch's probe finds it in both. Before, the probe sent a one-word prompt pinned to
    slot 1, which overwrote the prefix there, and its unpinned repeat then landed on slot 1
    and computed the prefix again: about 314 tokens on every server for every batch (the
    pool benchmark without a host cache)."""
    with LlamaServer(engine_paths, parallel=2, threads=1,
                     extra_args=("--cache-ram", "0")) as server:
        first = asyncio.run(_probe(server.llamacpp_url))
        before = prompt_tokens_total(server.http_url)
        second = asyncio.run(_probe(server.llamacpp_url))
        computed = prompt_tokens_total(server.http_url) - before
    print(f"first {first}; second {second}; prompt tokens computed by the second {computed:.0f}")
    assert first is not None and first.pinning_keeps_prefix, first
    assert second is not None and second.pinning_keeps_prefix, second
    assert computed <= SLACK, (computed, second)
