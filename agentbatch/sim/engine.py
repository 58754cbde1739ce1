"""Schedulers that decide when each simulated sequence gets its first token and finishes.

``FixedEngine`` charges a flat latency per request (one timer, unlimited concurrency).
``BatchEngine`` mimics a continuous-batching GPU server: one asyncio task runs engine steps,
a bounded running set decodes together, the rest queue FIFO, and newly admitted sequences pay
prefill for their uncached prompt tokens. Neither uses threads or busy waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from dataclasses import dataclass, field

from agentbatch.sim.config import SimConfig
from agentbatch.sim.metrics import SimStats
from agentbatch.sim.tokens import BLOCK_TOKENS, PrefixCache, cached_tokens

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """The waiting queue is at ``max_waiting``; the request should get a 429."""


@dataclass(eq=False)
class Sequence:
    """One prompt being served; handlers await its futures, the engine resolves them."""

    prompt_tokens: int
    hashes: list[int]
    completion_tokens: int
    cached_tokens: int = 0
    generated: int = 0
    state: str = "new"  # new | waiting | running | finished | cancelled
    first_token: asyncio.Future[float] = field(init=False)
    done: asyncio.Future[None] = field(init=False)
    progress: asyncio.Event = field(init=False, default_factory=asyncio.Event)
    timer: asyncio.TimerHandle | None = None

    def __post_init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.first_token = loop.create_future()
        self.done = loop.create_future()


class _Base:
    def __init__(self, config: SimConfig, stats: SimStats, cache: PrefixCache) -> None:
        self.config, self.stats, self.cache = config, stats, cache
        self.num_running = 0
        self.num_waiting = 0

    def _publish(self) -> None:
        self.stats.set_load(self.num_running, self.num_waiting)

    def _prefill(self, seq: Sequence) -> None:
        """Admit: look up and fill the prefix cache, count prompt tokens."""
        blocks = self.cache.match_and_insert(seq.hashes)
        seq.cached_tokens = cached_tokens(blocks, seq.prompt_tokens)
        seq.state = "running"
        self.stats.prompt_tokens += seq.prompt_tokens
        self.stats.cached_tokens += seq.cached_tokens

    def _finish(self, seq: Sequence, now: float) -> None:
        if not seq.first_token.done():
            seq.first_token.set_result(now)
        seq.generated = seq.completion_tokens
        seq.state = "finished"
        if not seq.done.done():
            seq.done.set_result(None)
        seq.progress.set()
        self.num_running -= 1

    def cache_usage(self) -> float:
        return 0.0

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


class FixedEngine(_Base):
    """Every request takes ``fixed_ms``: one timer per request, no queue."""

    def submit(self, seq: Sequence) -> None:
        self._prefill(seq)
        self.num_running += 1
        self._publish()
        loop = asyncio.get_running_loop()
        seq.timer = loop.call_later(self.config.fixed_ms / 1000.0, self._done, seq)  # type: ignore[operator]

    def _done(self, seq: Sequence) -> None:
        self._finish(seq, asyncio.get_running_loop().time())
        self._publish()

    def cancel(self, seq: Sequence) -> None:
        if seq.state == "running":
            if seq.timer is not None:
                seq.timer.cancel()
            seq.state = "cancelled"
            self.num_running -= 1
            self._publish()


class BatchEngine(_Base):
    """Continuous batching: ``max_running`` sequences per step, FIFO waiting queue."""

    def __init__(self, config: SimConfig, stats: SimStats, cache: PrefixCache) -> None:
        super().__init__(config, stats, cache)
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="agentbatch-sim-engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def submit(self, seq: Sequence) -> None:
        limit = self.config.max_waiting
        if limit is not None and self.num_waiting >= limit:
            raise QueueFull
        seq.state = "waiting"
        self._waiting.append(seq)
        self.num_waiting += 1
        self._publish()
        self._wake.set()

    def cancel(self, seq: Sequence) -> None:
        """Abort a sequence whose client went away (it is dropped lazily from the lists)."""
        if seq.state == "waiting":
            self.num_waiting -= 1
        elif seq.state == "running":
            self.num_running -= 1
        else:
            return
        seq.state = "cancelled"
        self._publish()

    def cache_usage(self) -> float:
        """KV blocks held by running sequences, as a fraction of the cache."""
        blocks = sum(
            (s.prompt_tokens + s.generated) // BLOCK_TOKENS + 1
            for s in self._running
            if s.state == "running"
        )
        return min(1.0, blocks / self.config.cache_blocks)

    def _admit(self) -> list[Sequence]:
        admitted = []
        while self._waiting and len(self._running) < self.config.max_running:
            seq = self._waiting.popleft()
            if seq.state != "waiting":
                continue
            self.num_waiting -= 1
            self._prefill(seq)
            self.num_running += 1
            self._running.append(seq)
            admitted.append(seq)
        self._publish()
        return admitted

    def _step_seconds(self, admitted: list[Sequence]) -> float:
        cfg = self.config
        uncached = sum(s.prompt_tokens - s.cached_tokens for s in admitted)
        n = len(self._running)
        decode = cfg.tokens_per_step * cfg.decode_ms * (1 + cfg.decode_batch_slope * n)
        return (uncached * cfg.prefill_ms_per_token + (decode if n else 0.0)) / 1000.0

    def _advance(self, admitted: list[Sequence]) -> None:
        now = asyncio.get_running_loop().time()
        for seq in admitted:
            if seq.state == "running" and not seq.first_token.done():
                seq.first_token.set_result(now)
        keep = []
        for seq in self._running:
            if seq.state != "running":
                continue
            seq.generated = min(seq.completion_tokens, seq.generated + self.config.tokens_per_step)
            if seq.generated >= seq.completion_tokens:
                self._finish(seq, now)
            else:
                keep.append(seq)
                seq.progress.set()
        self._running = keep
        self._publish()

    async def _loop(self) -> None:
        while True:
            try:
                if not self._running and not self._waiting:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                self._running = [s for s in self._running if s.state == "running"]
                admitted = self._admit()
                await asyncio.sleep(self._step_seconds(admitted))
                self._advance(admitted)
            except asyncio.CancelledError:
                raise
            except Exception:  # keep serving: a bug here must not hang every client
                log.exception("sim engine step failed")
                await asyncio.sleep(0.01)


def make_engine(
    config: SimConfig, stats: SimStats, cache: PrefixCache
) -> FixedEngine | BatchEngine:
    if config.fixed_ms is not None:
        return FixedEngine(config, stats, cache)
    return BatchEngine(config, stats, cache)
