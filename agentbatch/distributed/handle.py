"""A handle on a distributed batch: reads the batch's result stream from any process.

Each read remembers the stream id it reached (``cursor``), so a reader that stops can resume
exactly where it left off, from this process or another one (``get_batch``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import redis
from pydantic import BaseModel

from agentbatch.core.agent_state import AgentStatus
from agentbatch.core.errors import BatchExpired, BatchLost
from agentbatch.core.output import OutputContract
from agentbatch.core.results import AgentResult
from agentbatch.distributed.progress import DistributedProgress
from agentbatch.distributed.state.connection import async_client, mask_url, sync_client
from agentbatch.distributed.state.keys import BatchKeys
from agentbatch.distributed.state.redis_store import CANCEL_GONE, cancel_batch
from agentbatch.distributed.state.replies import range_entries, read_entries, str_hash, str_values
from agentbatch.distributed.state.retention import (
    delete_batch,
    missing_error,
    oom_error,
    out_of_memory,
)
from agentbatch.distributed.state.transcripts import aread_kept, read_kept
from agentbatch.turnloop.handle import BatchHandle
from agentbatch.turnloop.progress import BatchProgress
from agentbatch.turnloop.validate import check_cursor

log = logging.getLogger(__name__)
_BLOCK_MS = 1000
_READ_COUNT = 500
_RECONNECT_WINDOW_S = 30.0
_OOM_CHECK_S = 5.0  # while no result arrives, how often a reader asks whether Redis is full


class DistributedHandle(BatchHandle):
    def __init__(self, batch_id: str, redis_url: str, *, total: int,
                 schema: type[BaseModel] | None = None) -> None:
        self.batch_id = batch_id
        self.redis_url = redis_url
        self.total = total
        self.keys = BatchKeys(batch_id)
        self.contract = OutputContract(schema)
        self.cursor = "0-0"
        self._client = sync_client(redis_url, socket_timeout=_BLOCK_MS / 1000 + 10)
        self._progress: DistributedProgress | None = None

    # --- reading --------------------------------------------------------------------------

    def _decode(self, fields: dict[str, str],
                kept: dict[int, list[dict[str, Any]]] | None = None) -> AgentResult:
        """The entry's result, with its kept conversation from ``kept`` (``read_kept``)."""
        result = AgentResult.model_validate_json(fields["r"])
        if kept and result.index in kept:
            result = result.model_copy(update={"messages": kept[result.index]})
        if result.ok and self.contract.schema is not None and isinstance(result.output, dict):
            result = result.model_copy(update={"output": self.contract.instance(result.output)})
        return result

    def _first(self, seen: bytearray, fields: dict[str, str]) -> bool:
        """False for a second result of an agent in one read. After a Sentinel failover an
        agent whose final commit the old primary acknowledged but never replicated runs
        again, and its result is written again; a reader that saw the first one skips it."""
        try:
            index = int(fields["i"])
        except (KeyError, ValueError):
            return True
        if not 0 <= index < len(seen):
            return True
        if seen[index]:
            log.warning("batch %s: skipped a second result of agent %d (written again after "
                        "a Redis failover lost its first commit)", self.batch_id, index)
            return False
        seen[index] = 1
        return True

    def _lost(self, why: str, *, reachable: bool = True) -> BatchLost | BatchExpired:
        """``BatchExpired`` when the batch's tombstone says its keys went on purpose
        (retention, delete), else ``BatchLost``."""
        expired = None
        if reachable:
            with contextlib.suppress(redis.RedisError):
                expired = missing_error(self._client, self.batch_id)
        if expired is not None:
            return expired
        return BatchLost(f"batch {self.batch_id} is lost: {why} "
                         f"(Redis at {mask_url(self.redis_url)})")

    def _check_alive(self, client: Any) -> bool:
        """True when the batch has finished; raises BatchLost when its state is gone."""
        exists, finished = client.exists(self.keys.plan), client.hget(self.keys.meta, "finished")
        if not exists:
            raise self._lost("its state is no longer in Redis; the server restarted without "
                             "persistence or the keys were deleted or evicted")
        return finished == "1"

    def _check_memory(self) -> None:
        """Raise ``RedisOutOfMemory`` when Redis refuses writes: the batch cannot progress
        until memory is freed, and a reader must not wait on it in silence. Resume reading
        with ``results(after=handle.cursor)`` once memory is freed."""
        why = out_of_memory(self._client)
        if why is not None:
            raise oom_error(self.batch_id, why)

    def results(self, timeout: float | None = None, after: str | None = None
                ) -> Iterator[AgentResult]:
        """Results as agents finish; ``after`` resumes from a saved stream id."""
        cursor = check_cursor(after)
        seen = bytearray(self.total)  # one byte per agent: each result once per read
        deadline = None if timeout is None else time.monotonic() + timeout
        failing_since: float | None = None
        next_memory_check = time.monotonic() + _OOM_CHECK_S
        while True:
            try:
                reply = self._client.xread({self.keys.results: cursor}, count=_READ_COUNT,
                                           block=_BLOCK_MS)
                failing_since = None
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since > _RECONNECT_WINDOW_S:
                    raise self._lost(f"Redis has been unreachable for "
                                     f"{_RECONNECT_WINDOW_S:.0f}s ({exc})",
                                     reachable=False) from exc
                time.sleep(0.5)
                continue
            entries = read_entries(reply)
            kept = read_kept(self._client, self.keys, entries)
            for entry_id, fields in entries:
                cursor = self.cursor = entry_id
                if self._first(seen, fields):
                    yield self._decode(fields, kept)
            if entries:
                next_memory_check = time.monotonic() + _OOM_CHECK_S
                continue
            if self._check_alive(self._client):
                tail = self._client.xread({self.keys.results: cursor}, count=_READ_COUNT)
                if not tail:
                    return
                continue
            if time.monotonic() >= next_memory_check:
                next_memory_check = time.monotonic() + _OOM_CHECK_S
                self._check_memory()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"batch {self.batch_id}: no result within {timeout}s")

    async def aresults(self, after: str | None = None) -> AsyncIterator[AgentResult]:
        cursor = check_cursor(after)
        client = async_client(self.redis_url, socket_timeout=_BLOCK_MS / 1000 + 10)
        seen = bytearray(self.total)
        next_memory_check = time.monotonic() + _OOM_CHECK_S
        try:
            while True:
                reply = await client.xread({self.keys.results: cursor}, count=_READ_COUNT,
                                           block=_BLOCK_MS)
                entries = read_entries(reply)
                kept = await aread_kept(client, self.keys, entries)
                for entry_id, fields in entries:
                    cursor = self.cursor = entry_id
                    if self._first(seen, fields):
                        yield self._decode(fields, kept)
                if entries:
                    next_memory_check = time.monotonic() + _OOM_CHECK_S
                    continue
                exists = await client.exists(self.keys.plan)
                if not exists:
                    raise await asyncio.to_thread(self._lost, "its state is no longer in Redis")
                finished = await client.hget(self.keys.meta, "finished") == "1"
                if finished and not await client.xread({self.keys.results: cursor}, count=1):
                    return
                if not finished and time.monotonic() >= next_memory_check:
                    next_memory_check = time.monotonic() + _OOM_CHECK_S
                    await asyncio.to_thread(self._check_memory)
        finally:
            await client.aclose()

    def delivered(self) -> list[AgentResult]:
        """The results delivered so far, in input order, without waiting for the rest (what
        ``agentbatch export`` writes). Raises ``BatchExpired`` / ``BatchLost`` when the
        batch's keys are gone."""
        if not self._client.exists(self.keys.plan):
            raise self._lost("its state is no longer in Redis")
        seen, found, start = bytearray(self.total), [], "-"
        while chunk := range_entries(self._client.xrange(self.keys.results, min=start,
                                                          count=_READ_COUNT)):
            kept = read_kept(self._client, self.keys, chunk)
            found += [self._decode(f, kept) for _, f in chunk if self._first(seen, f)]
            start = "(" + chunk[-1][0]
        return sorted(found, key=lambda r: r.index)

    # --- control --------------------------------------------------------------------------

    def status(self) -> dict[str, int]:
        meta = str_hash(self._client.hgetall(self.keys.meta))
        if not meta:
            raise self._lost("its state is no longer in Redis")
        counts = {k[2:]: int(v) for k, v in meta.items() if k.startswith("n:") and int(v)}
        counts.update({k: int(meta.get(k, 0)) for k in ("total", "delivered")})
        # commits count only what moves (commit.lua): the rest of the live agents need the model
        running = counts["total"] - counts["delivered"]
        needs_model = running - counts.get(AgentStatus.AWAITING_TOOLS.value, 0)
        if needs_model:
            counts[AgentStatus.NEEDS_MODEL.value] = needs_model
        counts["finished"] = int(meta.get("finished", 0))
        counts["recovering"] = self._recovering()
        counts.update({k: int(v) for k, v in meta.items() if k.startswith("stat:")})
        if not counts["finished"]:
            why = out_of_memory(self._client)
            if why is not None:
                raise oom_error(self.batch_id, why, counts)
        return counts

    def progress(self) -> BatchProgress:
        """A snapshot read from Redis at a bounded cost (``distributed_progress.py``); the
        handle keeps the reader, so each result is read once however often this is called.
        Raises ``BatchExpired`` / ``BatchLost`` when the batch's keys are gone."""
        if self._progress is None:
            self._progress = DistributedProgress(self._client, self.batch_id, self.total,
                                                 self._recovering)
        return self._progress.snapshot(self._meta)

    def _meta(self) -> dict[str, str]:
        meta = str_hash(self._client.hgetall(self.keys.meta))
        if not meta:
            raise self._lost("its state is no longer in Redis")
        return meta

    def _recovering(self) -> int:
        """Agents the sweep re-sent that have not progressed since: their ``resends`` entry
        ("version:n") is still at their current version. Commits never clear the hash (one
        command less per transition), so it is compared here, where it is rare."""
        resends = str_hash(self._client.hgetall(self.keys.resends))
        if not resends:
            return 0
        indices = list(resends)
        entries = str_values(self._client.hmget(self.keys.state, indices))
        return sum(1 for i, e in zip(indices, entries, strict=True)
                   if e is not None and resends[i].split(":", 1)[0] == e.partition(":")[0])

    def cancel(self) -> None:
        """Workers stop each agent at its next step; each ends with error kind ``cancelled``.
        The commit that ends the last agent sets the batch's retention TTL, as for any
        finished batch. A finished batch is left as it is; one whose keys are gone raises
        ``BatchExpired`` (``BatchLost`` if it went without a tombstone), writing nothing."""
        if cancel_batch(self._client, self.batch_id) == CANCEL_GONE:
            raise self._lost("its state is no longer in Redis, so there is nothing to cancel")

    def delete(self, *, force: bool = False) -> int:
        """Remove the batch's keys from Redis now, instead of at the end of its retention;
        returns how many keys went. A batch still running raises ``ValueError`` unless
        ``force`` (which cancels it first). Reading it afterwards raises ``BatchExpired``."""
        return delete_batch(self._client, self.batch_id, force=force)

    def close(self) -> None:
        self._client.close()
