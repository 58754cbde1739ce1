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
from typing import Any, Literal

import redis
from pydantic import BaseModel

from agentbatch.core.agent_state import AgentStatus
from agentbatch.core.errors import BatchExpired, BatchLost
from agentbatch.core.output import OutputContract
from agentbatch.core.results import AgentResult
from agentbatch.distributed.progress import DistributedProgress
from agentbatch.distributed.result_reading import TRANSIENT, StreamRead
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
_Next = Literal["entries", "idle", "again", "ended"]  # what a read of the stream found
_Entries = list[tuple[str, dict[str, str]]]
_Kept = dict[int, list[dict[str, Any]]] | None


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

    def _reader(self, after: str | None) -> StreamRead:
        return StreamRead(self.batch_id, self.total, check_cursor(after),
                          lambda why: self._lost(why, reachable=False))

    def _step(self, read: StreamRead) -> tuple[_Next, _Entries, _Kept]:
        """One blocking read of the stream, and whether the batch has ended."""
        reply = self._client.xread({self.keys.results: read.cursor}, count=_READ_COUNT,
                                   block=_BLOCK_MS)
        entries = read_entries(reply)
        if entries:
            return "entries", entries, read_kept(self._client, self.keys, entries)
        if not self._check_alive(self._client):
            return "idle", [], None
        if self._client.xread({self.keys.results: read.cursor}, count=1):
            return "again", [], None  # written just before the batch finished
        return "ended", [], None

    async def _astep(self, client: Any, read: StreamRead) -> tuple[_Next, _Entries, _Kept]:
        """``_step`` on an asyncio client."""
        reply = await client.xread({self.keys.results: read.cursor}, count=_READ_COUNT,
                                   block=_BLOCK_MS)
        entries = read_entries(reply)
        if entries:
            return "entries", entries, await aread_kept(client, self.keys, entries)
        if not await client.exists(self.keys.plan):
            raise await asyncio.to_thread(self._lost, "its state is no longer in Redis")
        if await client.hget(self.keys.meta, "finished") != "1":
            return "idle", [], None
        if await client.xread({self.keys.results: read.cursor}, count=1):
            return "again", [], None
        return "ended", [], None

    def results(self, timeout: float | None = None, after: str | None = None
                ) -> Iterator[AgentResult]:
        """Results as agents finish; ``after`` resumes from a saved stream id. An unreachable
        Redis is retried for ``RECONNECT_WINDOW_S`` (``result_reading.py``)."""
        read = self._reader(after)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                step, entries, kept = self._step(read)
            except TRANSIENT as exc:
                time.sleep(read.unreachable(exc))
                continue
            read.reached()
            for _entry_id, fields in read.fresh(entries):
                self.cursor = read.cursor
                yield self._decode(fields, kept)
            self.cursor = read.cursor
            if step == "ended":
                return
            if step != "idle":
                continue
            if read.memory_check_due():
                self._check_memory()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"batch {self.batch_id}: no result within {timeout}s")

    async def aresults(self, after: str | None = None) -> AsyncIterator[AgentResult]:
        """``results()`` for asyncio: the same cursor, duplicate and outage rules."""
        read = self._reader(after)
        client = async_client(self.redis_url, socket_timeout=_BLOCK_MS / 1000 + 10)
        try:
            while True:
                try:
                    step, entries, kept = await self._astep(client, read)
                except TRANSIENT as exc:
                    await asyncio.sleep(read.unreachable(exc))
                    continue
                read.reached()
                for _entry_id, fields in read.fresh(entries):
                    self.cursor = read.cursor
                    yield self._decode(fields, kept)
                self.cursor = read.cursor
                if step == "ended":
                    return
                if step == "idle" and read.memory_check_due():
                    await asyncio.to_thread(self._check_memory)
        finally:
            await client.aclose()

    def delivered(self) -> list[AgentResult]:
        """The results delivered so far, in input order, without waiting for the rest (what
        ``agentbatch export`` writes). Raises ``BatchExpired`` / ``BatchLost`` when the
        batch's keys are gone."""
        if not self._client.exists(self.keys.plan):
            raise self._lost("its state is no longer in Redis")
        read, found, start = self._reader(None), [], "-"
        while chunk := range_entries(self._client.xrange(self.keys.results, min=start,
                                                          count=_READ_COUNT)):
            kept = read_kept(self._client, self.keys, chunk)
            found += [self._decode(f, kept) for _, f in read.fresh(chunk)]
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
