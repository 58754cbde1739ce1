"""Submit a compiled batch to Redis + Celery, or re-attach to one.

A batch is written in three steps, so that no single Redis command blocks the server for
long (one MULTI/EXEC of every agent blocked every other client, every worker's commit
included, for tens of ms at 20k agents: ``benchmarks/bench_scale.py``), and so that a submit
cut short never leaves a half batch that workers run or the sweep watches:

1. **Stage** the agents (``state`` and ``watch`` entries) in chunks of at most
   ``CHUNK_ENTRIES`` agents / ``CHUNK_BYTES`` bytes per command, pipelined without MULTI.
   Staged keys are invisible: no ``plan``, not in ``ab:batches``, no task queued, so no
   worker or sweep touches them. Each chunk renews a ``STAGING_TTL_MS`` expiry on them, so a
   submitter that dies mid-way leaves nothing behind for long.
2. **Commit** in one small MULTI/EXEC (O(1) commands): write ``plan`` and ``meta``, PERSIST
   the staged keys, add the batch to ``ab:batches``. It runs under WATCH of the staged keys
   after checking they hold every agent, so a staging that expired or was touched is refused
   instead of committed half. From here on the batch exists and runs whole.
3. **Enqueue** one turn task per agent, in chunked LPUSHes. If this is cut short, the batch
   is already complete in Redis and the recovery sweep sends the missing turns once their
   progress deadline passes; the submitter logs it.

A failure in step 1 or 2 unlinks the staged keys (UNLINK frees in the background, and is
allowed under Redis OOM) and raises an error naming the batch; if even that fails, the
staging TTL removes them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import redis

from ..backends.setup import open_backend, preflight_backend, warm_backend
from ..errors import (
    BackendError,
    BackendUnavailable,
    BatchSpecError,
    ConfigError,
    RedisOutOfMemory,
)
from ..state.connection import mask_url, refuse_cluster, sync_client
from ..state.keys import ACTIVE_BATCHES, TOMBSTONE_S, BatchKeys
from ..state.redis_store import (
    DEFAULT_RETENTION_S,
    deadline_score,
    initial_meta,
    now_ms,
    retention_ms,
    state_entry,
    sync_clock_blocking,
    unset_fields,
)
from ..state.retention import missing_error
from ..toolpool import resolve_tool
from ..workers.app import client_app
from ..workers.dispatch import Followup, broker_client, envelopes, turn_message
from ..workers.settings import WorkerSettings
from .compile import CompiledBatch
from .distributed_handle import DistributedHandle
from .options import BatchOptions
from .plan import BatchPlan
from .runtime import import_object

log = logging.getLogger(__name__)
T = TypeVar("T")
# Per Redis command: at most this many agents or payload bytes (whichever comes first).
# benchmarks/bench_scale.py: a 1000-agent HSET/ZADD/LPUSH blocks Redis about 1-3 ms here.
CHUNK_ENTRIES = 1000
CHUNK_BYTES = 1 << 20
STAGING_TTL_MS = 10 * 60 * 1000  # staged keys of a submitter that died mid-way expire after


class SubmitFailed(ConfigError):
    """Writing a batch failed before it was committed: nothing was enqueued and the batch
    does not exist (its partial writes were removed, or expire after ``STAGING_TTL_MS``)."""


def check_portable(compiled: CompiledBatch) -> None:
    """Refuse what a worker on another machine could not load, before anything is written."""
    for tool in compiled.tools:
        if not tool.import_path:
            raise BatchSpecError(
                f"tool {tool.name!r} cannot run on remote workers: it has no import path "
                "(define it with @tool at module level; lambdas, local functions and tools "
                "built at run time cannot be imported by a worker)")
        try:
            resolve_tool(tool.import_path)
        except BatchSpecError as exc:
            raise BatchSpecError(f"tool {tool.name!r} is not importable by workers: {exc}") \
                from None
    schema = compiled.contract.schema
    if schema is not None:
        path = compiled.plan.output_schema_path
        if not path:
            raise BatchSpecError(
                f"output_schema {schema.__qualname__} cannot be loaded by remote workers: "
                "it is defined inside a function; define it at module level")
        try:
            import_object(path)
        except Exception as exc:
            raise BatchSpecError(f"output_schema {path!r} is not importable: {exc}") from None


def _connect(url: str) -> redis.Redis:
    try:
        client = sync_client(url)
        client.ping()
        refuse_cluster(client)  # Cluster: one clear error, not CROSSSLOT from a script
    except redis.AuthenticationError as exc:
        raise ConfigError(f"Redis at {mask_url(url)} refused the credentials: {exc}") from None
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        raise ConfigError(f"cannot reach Redis at {mask_url(url)}: {exc}") from None
    return client


def chunks(items: Iterable[T], size: Callable[[T], int], *, max_entries: int | None = None,
           max_bytes: int | None = None) -> Iterator[list[T]]:
    """Consecutive runs of ``items`` of at most ``max_entries`` items (``CHUNK_ENTRIES``) and
    ``max_bytes`` bytes (``CHUNK_BYTES``); a single larger item is a chunk of its own."""
    max_entries = max_entries or CHUNK_ENTRIES
    max_bytes = max_bytes or CHUNK_BYTES
    chunk: list[T] = []
    used = 0
    for item in items:
        n = size(item)
        if chunk and (len(chunk) >= max_entries or used + n > max_bytes):
            yield chunk
            chunk, used = [], 0
        chunk.append(item)
        used += n
    if chunk:
        yield chunk


def staged_keys(k: BatchKeys) -> list[str]:
    """The batch's own per-agent keys step 1 writes (all O(agents)); everything else is O(1).

    The agents' progress deadlines go to the fleet-wide ``watch`` zset during staging too (so
    no committed agent is ever without one), but that zset is not the batch's: it is never
    expired or unlinked with it. The sweep leaves a due entry alone while its batch is still
    staging (``state`` without ``plan``) and drops the entries of a batch that has neither; a
    failed submit removes its own entries (``_unstage``)."""
    return [k.state]


def _stage(client: redis.Redis, k: BatchKeys, states: Sequence[Any], deadline: int) -> int:
    """Step 1: write every agent's versioned state and progress deadline in chunks; returns
    how many agents were staged."""
    rows = ((s.index, state_entry(s.version, s.model_dump_json(exclude=unset_fields(s))))
            for s in states)
    keys = staged_keys(k)
    done = 0
    score = deadline_score(deadline, started=False)
    for chunk in chunks(rows, lambda row: len(row[1]) + 16):
        with client.pipeline(transaction=False) as p:
            p.hset(k.state, mapping=dict(chunk))
            p.zadd(k.watch, {k.member(i): score for i, _ in chunk})
            for key in keys:
                p.pexpire(key, STAGING_TTL_MS)
            p.execute()
        done += len(chunk)
    return done


def _commit(client: redis.Redis, k: BatchKeys, plan: BatchPlan, retention_s: float) -> None:
    """Step 2: make the staged batch live in one O(1) transaction, only if it is whole."""
    keys = staged_keys(k)
    with client.pipeline(transaction=True) as p:
        p.watch(*keys)
        have = p.hlen(k.state)
        if have != plan.total:
            raise SubmitFailed(
                f"batch {plan.batch_id}: the staged agents are incomplete at commit "
                f"(the state hash holds {have}, expected {plan.total}; did they expire "
                f"after {STAGING_TTL_MS // 1000} s or get deleted?)")
        p.multi()
        p.set(k.plan, plan.model_dump_json())
        p.hset(k.meta, mapping=initial_meta(plan, retention_s))
        for key in keys:
            p.persist(key)
        p.sadd(ACTIVE_BATCHES, plan.batch_id)
        p.execute()


def _unstage(client: redis.Redis, k: BatchKeys, total: int) -> bool:
    """Remove a failed submit's staged keys and deadlines; False when Redis cannot be reached
    (the staging TTL removes the keys then, and the sweep the deadlines once due)."""
    try:
        client.unlink(*staged_keys(k))
        for chunk in chunks(range(total), lambda _: 1):
            client.zrem(k.watch, *(k.member(i) for i in chunk))
        return True
    except redis.RedisError:
        log.warning("could not remove the staged keys of batch %s; they expire in %d s",
                    k.batch_id, STAGING_TTL_MS // 1000, exc_info=True)
        return False


def write_batch(client: redis.Redis, plan: BatchPlan, compiled: CompiledBatch,
                grace_ms: int, retention_s: float = DEFAULT_RETENTION_S) -> None:
    """Steps 1 and 2 (see the module docstring); raises ``SubmitFailed`` (or
    ``RedisOutOfMemory`` when Redis is full) when the batch was not committed.

    ``retention_s`` travels with the batch (in ``meta``): the commit that finishes it sets
    that TTL on its keys."""
    k = BatchKeys(plan.batch_id)
    if client.exists(k.plan, *staged_keys(k)):
        raise BatchSpecError(f"a batch with id {plan.batch_id!r} already exists")
    sync_clock_blocking(client)  # deadlines in Redis's clock, like the workers'
    states = compiled.states
    if not states:  # finished as written: no commit will ever set its retention
        keep = retention_ms(retention_s)
        with client.pipeline(transaction=True) as p:
            p.set(k.plan, plan.model_dump_json(), px=keep)
            p.hset(k.meta, mapping=initial_meta(plan, retention_s))
            p.pexpire(k.meta, keep)
            p.set(k.gone, json.dumps({"reason": "expired", "finished_at_ms": now_ms(),
                                      "retention_ms": keep}), px=keep + TOMBSTONE_S * 1000)
            p.execute()
        return
    staged = 0
    try:
        staged = _stage(client, k, states, now_ms() + grace_ms)
        _commit(client, k, plan, retention_s)
    except BaseException as exc:
        removed = _unstage(client, k, len(states))
        if not isinstance(exc, redis.RedisError | SubmitFailed):
            raise  # KeyboardInterrupt & co.: the batch was not committed and is cleaned up
        where = (f"after staging {staged} of {len(states)} agents" if staged == len(states)
                 else f"part-way through staging ({len(states)} agents)")
        tail = ("its partial writes were removed" if removed else
                f"its partial writes expire within {STAGING_TTL_MS // 1000} s")
        msg = (f"submitting batch {plan.batch_id} failed {where}: {exc}. The batch was not "
               f"started and nothing was enqueued; {tail}.")
        if isinstance(exc, redis.exceptions.OutOfMemoryError):
            raise RedisOutOfMemory(msg) from exc
        raise SubmitFailed(msg) from exc


def enqueue(app: Any, followups: list[Followup]) -> None:
    """Step 3: LPUSH the turn messages, many per command, chunked like the staging.

    LPUSH of m0, m1, ... leaves m0 at the tail, where kombu's BRPOP takes first: the same
    order as one LPUSH per message."""
    by_queue: dict[str, list[str]] = {}
    for key, payload in envelopes(app, followups):
        by_queue.setdefault(key, []).append(payload)
    client = broker_client(app)
    for key, payloads in by_queue.items():
        for chunk in chunks(payloads, len):
            client.lpush(key, *chunk)


async def _warm(plan: BatchPlan) -> None:
    backend = open_backend(plan.backends, timeout=min(plan.timeout_per_turn or 30.0, 30.0))
    try:
        await preflight_backend(backend, plan)
        if plan.warm_prefix and plan.total > 1:
            await warm_backend(backend, plan)
    finally:
        await backend.aclose()


def warm_from_submitter(plan: BatchPlan) -> None:
    """Fill the prefix cache and prove the backend answers, before anything is enqueued."""
    try:
        asyncio.run(_warm(plan))
    except BackendError as exc:
        raise BackendUnavailable(
            f"{exc} (nothing was enqueued; if only the workers can reach the inference "
            "servers, submit with warm_prefix=False)") from exc


def submit_distributed(compiled: CompiledBatch, opts: BatchOptions) -> DistributedHandle:
    url = opts.redis_url or ""
    settings = WorkerSettings.from_env(url)  # a bad AGENTBATCH_* value is refused up front
    check_portable(compiled)
    plan = compiled.plan
    client = _connect(url)
    # max_server_waiting needs the servers' /metrics checked here, before anything is enqueued.
    if (plan.warm_prefix and plan.total > 1) or plan.max_server_waiting is not None:
        try:
            warm_from_submitter(plan)
        except BaseException:
            client.close()
            raise
    try:
        write_batch(client, plan, compiled, settings.queue_grace_ms, settings.retention_s)
    except (redis.ConnectionError, redis.TimeoutError) as exc:  # before anything was written
        raise ConfigError(f"writing batch {plan.batch_id} to Redis at {mask_url(url)} failed; "
                          f"nothing was enqueued: {exc}") from None
    finally:
        client.close()
    messages = [turn_message(plan.batch_id, s, plan.max_turns) for s in compiled.states]
    try:
        enqueue(client_app(url), messages)
    except Exception:
        log.warning("enqueueing batch %s was cut short; the recovery sweep will send the "
                    "remaining turns", plan.batch_id, exc_info=True)
    handle = DistributedHandle(plan.batch_id, url, total=plan.total,
                               schema=compiled.contract.schema)
    if opts.on_result is not None:
        _start_callback_reader(handle, opts.on_result)
    return handle


def _start_callback_reader(handle: DistributedHandle, callback: Callable[[Any], Any]) -> None:
    reader = DistributedHandle(handle.batch_id, handle.redis_url, total=handle.total,
                               schema=handle.contract.schema)

    def run() -> None:
        for result in reader.results():
            try:
                callback(result)
            except Exception:
                log.exception("on_result raised for agent %s; the batch continues",
                              result.index)

    threading.Thread(target=run, name=f"agentbatch-on-result-{handle.batch_id}",
                     daemon=True).start()


def attach_distributed(batch_id: str, redis_url: str) -> DistributedHandle:
    client = _connect(redis_url)
    try:
        raw = client.get(BatchKeys(batch_id).plan)
        expired = missing_error(client, batch_id) if raw is None else None
    finally:
        client.close()
    if expired is not None:
        raise expired
    if raw is None:
        raise BatchSpecError(f"no batch {batch_id!r} in Redis at {mask_url(redis_url)}")
    plan = BatchPlan.model_validate_json(raw)
    schema = None
    if plan.output_schema_path:
        try:
            schema = import_object(plan.output_schema_path)
        except Exception:
            log.info("output schema %s not importable here; outputs stay dicts",
                     plan.output_schema_path)
    return DistributedHandle(batch_id, redis_url, total=plan.total, schema=schema)
