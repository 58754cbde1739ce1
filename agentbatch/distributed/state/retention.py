"""What a batch leaves in Redis once it is over: tombstones, deletion, listing, and the
out-of-memory check that turns a silent stall into an error.

The finishing commit (``commit.lua``) gives every key of a batch the retention TTL and writes
the ``gone`` tombstone; this module is the synchronous side that readers and the CLI use.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from typing import Any

import redis

from agentbatch.core.errors import BatchExpired, BatchSpecError, ConfigError, RedisOutOfMemory
from agentbatch.distributed.state.keys import ACTIVE_BATCHES, PREFIX, TOMBSTONE_S, WATCH, BatchKeys
from agentbatch.distributed.state.replies import str_hash

OOM_PROBE = f"{PREFIX}:oom:probe"  # a tiny write that Redis refuses exactly when workers' are
_UNLINK_CHUNK = 500


class BatchRunning(ValueError):
    """Deleting a batch that has not finished needs ``force`` (which cancels it first)."""


def tombstone(client: redis.Redis, batch_id: str) -> dict[str, Any] | None:
    raw = client.get(BatchKeys(batch_id).gone)
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        return {"reason": "expired"}
    return value if isinstance(value, dict) else {"reason": "expired"}


def _when(ms: Any) -> str:
    if not isinstance(ms, int | float):
        return "at an unknown time"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ms / 1000))


def expired_error(batch_id: str, tomb: dict[str, Any]) -> BatchExpired:
    if tomb.get("reason") == "deleted":
        return BatchExpired(f"batch {batch_id} was deleted {_when(tomb.get('deleted_at_ms'))} "
                            "(handle.delete() / agentbatch rm)")
    keep = tomb.get("retention_ms")
    kept = f"{keep / 1000:g}s" if isinstance(keep, int | float) else "its retention"
    return BatchExpired(f"batch {batch_id} finished {_when(tomb.get('finished_at_ms'))} and its "
                        f"keys expired after {kept} (AGENTBATCH_RETENTION_S at submit)")


def missing_error(client: redis.Redis, batch_id: str) -> BatchExpired | None:
    """``BatchExpired`` when the batch's tombstone says why its keys are gone, else None."""
    tomb = tombstone(client, batch_id)
    return None if tomb is None else expired_error(batch_id, tomb)


def batch_keys(client: redis.Redis, batch_id: str) -> list[str]:
    """Every key of the batch (leases and tool fan-in included), tombstone excluded."""
    k = BatchKeys(batch_id)
    return [key for key in client.scan_iter(match=k.pattern(), count=1000) if key != k.gone]


def delete_batch(client: redis.Redis, batch_id: str, *, force: bool = False) -> int:
    """Remove every key of the batch now and leave a ``deleted`` tombstone; returns how many
    keys went. A batch still running needs ``force``, which cancels it first: workers stop
    at their next step, and every script they run checks the version in the state hash,
    deleted first, so nothing writes the batch back. Works while Redis is out of memory
    (UNLINK is allowed then), which is when deleting matters most.

    Deleting is the operators' job: the least-privilege submitter user of
    ``deploy/redis-users.acl`` may create batches but not remove any, and gets a
    ``ConfigError`` saying so."""
    try:
        return _delete_batch(client, batch_id, force=force)
    except redis.exceptions.NoPermissionError as exc:
        raise ConfigError(
            f"deleting batch {batch_id} needs the operators' Redis user (the default user of "
            f"deploy/redis-users.acl); this connection's user may not: {exc}. The batch's "
            "keys expire by themselves after its retention") from None


def _delete_batch(client: redis.Redis, batch_id: str, *, force: bool) -> int:
    k = BatchKeys(batch_id)
    meta = str_hash(client.hgetall(k.meta))
    if not meta and not client.exists(k.plan, k.state):
        gone = missing_error(client, batch_id)
        if gone is not None:
            raise gone
        raise BatchSpecError(f"no batch {batch_id!r} in Redis")
    if meta.get("finished") != "1":
        if not force:
            raise BatchRunning(
                f"batch {batch_id} is still running ({meta.get('delivered', '?')}/"
                f"{meta.get('total', '?')} delivered); cancel it first or force the delete "
                "(which cancels it)")
        # under OOM this write is refused: deleting the state hash stops the workers anyway
        with contextlib.suppress(redis.exceptions.OutOfMemoryError):
            client.hset(k.meta, "cancelled", 1)
    client.srem(ACTIVE_BATCHES, batch_id)
    removed = int(client.unlink(k.state, k.plan, k.meta))
    total = int(meta.get("total", 0) or 0)  # its live agents' deadlines, in the fleet's zset
    for start in range(0, total, _UNLINK_CHUNK):
        client.zrem(WATCH, *(k.member(i) for i in range(start, min(start + _UNLINK_CHUNK, total))))
    # its shared tool calls' cache, locks and results: a share="fleet" tool's are the fleet's
    keys = [*batch_keys(client, batch_id), *client.scan_iter(match=k.tool_pattern(), count=1000)]
    for start in range(0, len(keys), _UNLINK_CHUNK):
        removed += int(client.unlink(*keys[start:start + _UNLINK_CHUNK]))
    # still out of memory after the deletes: a later reader gets BatchLost, not BatchExpired
    with contextlib.suppress(redis.exceptions.OutOfMemoryError):
        client.set(k.gone, json.dumps({"reason": "deleted",
                                       "deleted_at_ms": int(time.time() * 1000)}),
                   px=TOMBSTONE_S * 1000)
    return removed


def out_of_memory(client: redis.Redis) -> str | None:
    """Why Redis refuses writes, or None when it accepts them.

    Probes with the smallest write (a 1 ms key): Redis refuses it under ``noeviction`` at
    ``maxmemory`` exactly as it refuses the workers' commits, whatever INFO's accounting."""
    try:
        client.set(OOM_PROBE, "1", px=1)
        return None
    except redis.exceptions.OutOfMemoryError as exc:
        detail = str(exc)
    try:
        info = client.info("memory")
        detail = (f"used_memory {info.get('used_memory_human')} of maxmemory "
                  f"{info.get('maxmemory_human')}, policy {info.get('maxmemory_policy')}")
    except redis.RedisError:
        pass
    return (f"Redis is out of memory ({detail}) and refuses writes: workers cannot commit, "
            "so the batch is stalled until memory is freed. Delete finished batches "
            "(agentbatch ls / agentbatch rm), lower AGENTBATCH_RETENTION_S, or raise maxmemory")


def oom_error(batch_id: str, why: str, status: dict[str, int] | None = None
              ) -> RedisOutOfMemory:
    progress = ""
    if status:
        progress = f" at {status.get('delivered', '?')}/{status.get('total', '?')} delivered"
    return RedisOutOfMemory(f"batch {batch_id} is stalled{progress}: {why}", status)


@dataclass
class BatchInfo:
    batch_id: str
    status: str  # running | cancelling | finished | cancelled | partial | damaged
    total: int
    delivered: int
    created_at: float | None
    ttl_s: float | None  # None: no TTL (still running)
    keys: int
    bytes: int

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _status(meta: dict[str, str]) -> str:
    cancelled = meta.get("cancelled") == "1"
    if meta.get("finished") == "1":
        return "cancelled" if cancelled else "finished"
    return "cancelling" if cancelled else "running"


def list_batches(client: redis.Redis, *, sizes: bool = True) -> list[BatchInfo]:
    """Every batch with keys in Redis, oldest first: one SCAN over ``ab:{*}`` grouped by
    batch, then the meta hashes (and MEMORY USAGE of each key when ``sizes``) pipelined."""
    grouped: dict[str, list[str]] = {}
    head = f"{PREFIX}:{{"
    for key in client.scan_iter(match=f"{head}*", count=1000):
        end = key.find("}:", len(head))
        if end < 0:
            continue
        grouped.setdefault(key[len(head):end], []).append(key)
    infos: list[BatchInfo] = []
    for batch_id, keys in grouped.items():
        k = BatchKeys(batch_id)
        keys = [key for key in keys if key != k.gone]
        if not keys:
            continue  # only the tombstone is left
        with client.pipeline(transaction=False) as p:
            p.hgetall(k.meta)
            p.pttl(k.meta)
            if sizes:
                for key in keys:
                    p.memory_usage(key)
            meta, pttl, *usage = p.execute()
        created = meta.get("created_at")
        status = _status(meta) if meta else "partial"
        try:
            total, delivered = int(meta.get("total", 0)), int(meta.get("delivered", 0))
            created_at = float(created) if created else None
        except ValueError:  # a damaged meta hash is one row, not the whole listing's crash
            status, total, delivered, created_at = "damaged", 0, 0, None
        infos.append(BatchInfo(
            batch_id=batch_id, status=status, total=total, delivered=delivered,
            created_at=created_at, ttl_s=pttl / 1000 if pttl and pttl > 0 else None,
            keys=len(keys), bytes=sum(int(u or 0) for u in usage)))
    infos.sort(key=lambda i: (i.created_at or 0.0, i.batch_id))
    return infos
