"""Schedulers and configuration plumbing (no HTTP; no timing assertions)."""

from __future__ import annotations

import asyncio

import pytest

from agentbatch.sim.__main__ import config_from_args
from agentbatch.sim.config import SimConfig, config_to_argv
from agentbatch.sim.engine import BatchEngine, FixedEngine, QueueFull, Sequence
from agentbatch.sim.metrics import SimStats
from agentbatch.sim.tokens import PrefixCache, block_hashes

FAST = {"decode_ms": 0.5, "prefill_ms_per_token": 0.0}


def seq(tokens: int = 8, prompt: str = "p" * 200) -> Sequence:
    return Sequence(len(prompt) // 4, block_hashes(prompt), tokens)


async def test_batch_engine_caps_running_and_queues_fifo():
    stats = SimStats()
    engine = BatchEngine(SimConfig(max_running=2, **FAST), stats, PrefixCache(100))
    await engine.start()
    try:
        seqs = [seq() for _ in range(6)]
        for s in seqs:
            engine.submit(s)
        assert stats.waiting == 6
        await asyncio.gather(*(s.done for s in seqs))
    finally:
        await engine.stop()
    assert stats.max_running_seen == 2 and stats.max_waiting_seen == 6
    assert stats.running == 0 and stats.waiting == 0
    firsts = [s.first_token.result() for s in seqs]
    assert firsts == sorted(firsts)  # FIFO admission
    assert all(s.generated == s.completion_tokens for s in seqs)
    assert seqs[0].cached_tokens == 0 and seqs[1].cached_tokens > 0  # same prompt: prefix hit
    assert stats.prompt_tokens == 6 * seqs[0].prompt_tokens


async def test_batch_engine_cancel_frees_the_slot_and_max_waiting_rejects():
    stats = SimStats()
    engine = BatchEngine(SimConfig(max_running=1, max_waiting=1, **FAST), stats, PrefixCache(100))
    await engine.start()
    try:
        hog, queued = seq(tokens=10**9), seq()
        engine.submit(hog)
        await hog.first_token
        engine.submit(queued)
        with pytest.raises(QueueFull):
            engine.submit(seq())
        engine.cancel(hog)
        await queued.done
        assert hog.state == "cancelled" and not hog.done.done()
    finally:
        await engine.stop()
    assert stats.running == 0 and stats.waiting == 0


async def test_fixed_engine_runs_everything_at_once():
    stats = SimStats()
    engine = FixedEngine(SimConfig(fixed_ms=1), stats, PrefixCache(100))
    seqs = [seq() for _ in range(50)]
    for s in seqs:
        engine.submit(s)
    assert stats.running == 50
    cancelled = seqs.pop()
    engine.cancel(cancelled)
    await asyncio.gather(*(s.done for s in seqs))
    assert stats.running == 0 and stats.max_running_seen == 50
    assert not cancelled.done.done()


def test_config_round_trips_through_the_command_line():
    config = SimConfig(
        port=1234,
        models=["a", "b"],
        accept_any_model=False,
        fixed_ms=2.5,
        max_waiting=7,
        fault_rates={"http_500": 0.1, "timeout": 0.01},
        seed=9,
    )
    assert config_from_args(config_to_argv(config)) == config
    assert config_from_args([]).port == 8000
    assert SimConfig(fault_rates="http_429=0.5").fault_rates == {"http_429": 0.5}
    with pytest.raises(ValueError):
        SimConfig(max_running=0)
