"""Counters a worker adds to batches' ``meta`` in the background, gathered, not per event.

A pool's moves and a hedge's outcome and loser tokens happen inside a model call, many per
second on a busy worker; so do ``pricing="auto"``'s routing and provider-batch hedge counts
(``provider_batches.py``). ``WorkerContext.note`` would spend a Redis round trip on each (two
or four per hedge); these counts are for operators, not for the turn machine, so they wait
here and are written every ``FLUSH_S`` at most: one round trip per flush for all the
batches that moved (a transaction of one ``note`` script per field, so ``handle.status()``
sees a flush whole, never a hedge without its outcome). ``note`` leaves a batch whose
``meta`` is gone alone, as for every other stat.

A count that must be on the batch before what follows it (a hedged turn's commit, a cancel
at the provider that a reader may see first) asks for ``settle``: a flush now, shared by every
caller in the same pass of the loop, so a burst of such events is still one round trip.

A flush that fails keeps its counts for the next one. What a process holds when it is
SIGKILLed (at most ``FLUSH_S`` worth) is lost: the counters are statistics, never state.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any

from agentbatch.distributed.state.keys import BatchKeys
from agentbatch.distributed.state.scripts import Scripts

log = logging.getLogger(__name__)

FLUSH_S = 0.5  # how late a count may reach the batch's meta


class BatchStats:
    """Per-batch counts waiting for their flush (``stat:<field>`` on the batch's meta)."""

    def __init__(self, redis: Any, scripts: Scripts, flush_s: float = FLUSH_S) -> None:
        self._redis = redis
        self._scripts = scripts
        self.flush_s = flush_s
        self._pending: dict[str, Counter[str]] = {}
        self._task: asyncio.Task[None] | None = None
        self._gathering: asyncio.Task[None] | None = None  # a settle not yet flushing
        self._writing: set[asyncio.Future[None]] = set()  # flushes under way, until they end

    def add(self, batch_id: str, field: str, n: int = 1) -> None:
        """Count ``n`` on ``stat:<field>`` of the batch, in the next flush (on the running
        loop: the worker's process loop)."""
        if n <= 0:
            return
        self._pending.setdefault(batch_id, Counter())[field] += n
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(
                self._flush_later(), name="agentbatch-batch-stats")

    def settle(self) -> asyncio.Future[None]:
        """Flush what waits now (not at the next timed flush); await the result for the
        counts to be written (or kept, on failure) first. Callers in the same pass of the
        loop share one flush; a caller after it has taken its counts gets the next one."""
        task = self._gathering
        if task is None or task.done():
            task = asyncio.get_running_loop().create_task(self._settle(),
                                                          name="agentbatch-batch-stats-now")
            self._gathering = task
        return asyncio.shield(task)

    async def _settle(self) -> None:
        await asyncio.sleep(0)  # the others counting in this pass of the loop join
        if self._gathering is asyncio.current_task():
            self._gathering = None  # counts added from now wait for the next settle
        earlier = list(self._writing)  # counts taken by a flush still under way: waited on
        await self.flush()
        if earlier:
            await asyncio.wait(earlier)

    def pending(self) -> dict[str, dict[str, int]]:
        """What waits for the next flush (for tests and debugging)."""
        return {b: dict(c) for b, c in self._pending.items()}

    async def _flush_later(self) -> None:
        while self._pending:
            await asyncio.sleep(self.flush_s)
            await self.flush()

    async def flush(self) -> None:
        """Write what waits now, in one round trip; on failure keep it for the next flush."""
        batch, self._pending = self._pending, {}
        if not batch:
            return
        writing = asyncio.get_running_loop().create_future()
        self._writing.add(writing)
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                for batch_id, counts in batch.items():
                    meta = BatchKeys(batch_id).meta
                    for field, n in counts.items():
                        await self._scripts.note(keys=[meta], args=[f"stat:{field}", n],
                                                 client=pipe)
                await pipe.execute()
        except Exception:  # statistics must never break a turn: retried with the next flush
            log.debug("could not write batch stats; kept for the next flush", exc_info=True)
            for batch_id, counts in batch.items():
                self._pending.setdefault(batch_id, Counter()).update(counts)
        finally:
            self._writing.discard(writing)
            writing.set_result(None)
