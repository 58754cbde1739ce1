"""Submit a compiled batch to Redis + Celery, or re-attach to one.

A batch is written in three steps, so that no single Redis command blocks the server for long
and a submit cut short never leaves a half batch that workers run or the sweep watches:
1. **Stage** agents, ``plan`` and ``meta`` in chunks under this submit's own names
   (``BatchKeys.staged``, expiring after ``STAGING_TTL_MS``), deadlines beyond that expiry;
2. **Commit** in one O(1) script (``submit.lua``: RENAMENX into place, never over an existing
   key; add to ``ab:batches``), then bring the deadlines forward to one queue grace;
3. **Enqueue** one turn task per agent in chunked LPUSHes (the sweep sends any left unsent).
A failure in step 1 or 2 removes the staged keys. In full: docs/distributed-turn.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import redis

from agentbatch.backends.base import Backend
from agentbatch.backends.setup import (
    open_backend,
    preflight_backend,
    slot_pinning,
    warm_backend,
)
from agentbatch.core.errors import (
    BackendError,
    BackendUnavailable,
    BatchSpecError,
    ConfigError,
    RedisOutOfMemory,
)
from agentbatch.core.import_allowlist import check_not_main
from agentbatch.core.options import BatchOptions
from agentbatch.core.plan import BatchPlan
from agentbatch.distributed.handle import DistributedHandle
from agentbatch.distributed.state.connection import mask_url, refuse_cluster, sync_client
from agentbatch.distributed.state.keys import ACTIVE_BATCHES, TOMBSTONE_S, BatchKeys
from agentbatch.distributed.state.redis_store import (
    DEFAULT_RETENTION_S,
    initial_meta,
    now_ms,
    retention_ms,
    state_entry,
    sync_clock_blocking,
    unset_fields,
)
from agentbatch.distributed.state.retention import missing_error
from agentbatch.distributed.state.scripts import source
from agentbatch.distributed.workers.app import client_app
from agentbatch.distributed.workers.dispatch import Followup, broker_client, envelopes, turn_message
from agentbatch.distributed.workers.settings import WorkerSettings
from agentbatch.toolpool import resolve_tool
from agentbatch.turnloop.batch_api import require_batch_client
from agentbatch.turnloop.compile import CompiledBatch
from agentbatch.turnloop.runtime import import_object
from agentbatch.turnloop.validate import deadline_in

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
        check_not_main(tool.import_path, "tool")
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
        check_not_main(path, "output_schema")
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


STAGED = ("state", "plan", "meta", "gone")  # the batch keys a submit stages, in submit.lua's order


def staged_keys(k: BatchKeys, token: str) -> list[str]:
    """Where submit ``token`` stages the batch's keys (``STAGED``), before ``submit.lua``.

    The agents' progress deadlines go to the fleet-wide ``watch`` zset during staging too (so
    no committed agent is ever without one), but that zset is not the batch's: it is never
    expired or unlinked with it. The sweep drops the due entries of a batch that has no keys
    (a failed or abandoned submit), which is why staged deadlines lie beyond the staging
    TTL."""
    return [k.staged(token, name) for name in STAGED]


def _stage(client: redis.Redis, k: BatchKeys, token: str, states: Sequence[Any]) -> int:
    """Step 1: write every agent's versioned state and progress deadline in chunks; returns
    how many agents were staged."""
    rows = ((s.index, state_entry(s.version, s.model_dump_json(exclude=unset_fields(s))))
            for s in states)
    state = k.staged(token, "state")
    done = 0
    for chunk in chunks(rows, lambda row: len(row[1]) + 16):
        score = now_ms() + 2 * STAGING_TTL_MS
        with client.pipeline(transaction=False) as p:
            p.hset(state, mapping=dict(chunk))
            p.zadd(k.watch, {k.member(i): score for i, _ in chunk})
            p.pexpire(state, STAGING_TTL_MS)
            p.execute()
        done += len(chunk)
    return done


def _go_live(client: redis.Redis, k: BatchKeys, token: str, total: int, *,
             running: bool) -> None:
    """Rename the staged keys into place (``submit.lua``): ``BatchSpecError`` when the batch
    id is taken, ``SubmitFailed`` when the staged state is not whole."""
    script = client.register_script(source("submit"))
    keys = [*staged_keys(k, token), k.state, k.plan, k.meta, k.gone, ACTIVE_BATCHES]
    try:
        script(keys=keys, args=[total, 1 if running else 0, k.batch_id])
    except redis.ResponseError as exc:
        why = str(exc)
        if why.startswith("EXISTS"):
            raise BatchSpecError(f"a batch with id {k.batch_id!r} already exists") from None
        if why.startswith("INCOMPLETE"):
            raise SubmitFailed(
                f"batch {k.batch_id}: the staged agents are incomplete at commit (the state "
                f"hash holds {why.split()[-1]}, expected {total}; did they expire after "
                f"{STAGING_TTL_MS // 1000} s or get deleted?)") from None
        raise


def _commit(client: redis.Redis, k: BatchKeys, token: str, plan: BatchPlan,
            retention_s: float) -> None:
    """Step 2: stage ``plan`` and ``meta`` (O(1)) and make the batch live, only if whole."""
    with client.pipeline(transaction=False) as p:
        p.set(k.staged(token, "plan"), plan.model_dump_json(), px=STAGING_TTL_MS)
        # redis-py types hset's mapping with an invariant key type: it refuses dict[str, ...]
        p.hset(k.staged(token, "meta"),
               mapping=initial_meta(plan, retention_s))  # type: ignore[arg-type]
        p.pexpire(k.staged(token, "meta"), STAGING_TTL_MS)
        p.execute()
    _go_live(client, k, token, plan.total, running=True)


def _arm_deadlines(client: redis.Redis, k: BatchKeys, total: int, grace_ms: int) -> None:
    """After the commit, before anything is enqueued: bring the agents' deadlines forward
    from beyond the staging TTL to one queue grace, so a lost first message is re-sent soon.
    If this is cut short, the staged deadlines still hold (a slower recovery, nothing lost)."""
    try:
        for chunk in chunks(range(total), lambda _: 1):
            score = now_ms() + grace_ms
            client.zadd(k.watch, {k.member(i): score for i in chunk}, xx=True)
    except redis.RedisError:
        log.warning("batch %s: could not bring its agents' deadlines forward; a lost first "
                    "message is re-sent within %d s", k.batch_id, 2 * STAGING_TTL_MS // 1000,
                    exc_info=True)


def _unstage(client: redis.Redis, k: BatchKeys, token: str) -> bool:
    """Remove a failed submit's staged keys; False when Redis cannot be reached (the staging
    TTL removes them then). Its deadlines stay until due, when the sweep drops them."""
    try:
        client.unlink(*staged_keys(k, token))
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
    if client.exists(k.plan, k.meta, k.state):
        raise BatchSpecError(f"a batch with id {plan.batch_id!r} already exists")
    sync_clock_blocking(client)  # deadlines in Redis's clock, like the workers'
    token = uuid.uuid4().hex
    states = compiled.states
    if not states:  # finished as written: no commit will ever set its retention
        keep = retention_ms(retention_s)
        with client.pipeline(transaction=False) as p:
            p.set(k.staged(token, "plan"), plan.model_dump_json(), px=keep)
            # redis-py types hset's mapping with an invariant key type: it refuses dict[str, ...]
            p.hset(k.staged(token, "meta"),
                   mapping=initial_meta(plan, retention_s))  # type: ignore[arg-type]
            p.pexpire(k.staged(token, "meta"), keep)
            p.set(k.staged(token, "gone"), json.dumps(
                {"reason": "expired", "finished_at_ms": now_ms(), "retention_ms": keep}),
                px=keep + TOMBSTONE_S * 1000)
            p.execute()
        try:
            _go_live(client, k, token, 0, running=False)
        except BaseException:
            _unstage(client, k, token)
            raise
        return
    staged = 0
    try:
        staged = _stage(client, k, token, states)
        _commit(client, k, token, plan, retention_s)
    except BaseException as exc:
        removed = _unstage(client, k, token)
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
    _arm_deadlines(client, k, len(states), grace_ms)


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
        plan.pinned_slots = await slot_pinning(backend)
        if plan.pricing != "sync":
            await check_batch_api(plan, backend)
        # all-batch turns skip the sync prefix cache it warms ("auto" sends some turns sync)
        if plan.pricing != "batch" and plan.warm_prefix and plan.total > 1:
            await warm_backend(backend, plan)
    finally:
        await backend.aclose()


async def check_batch_api(plan: BatchPlan, backend: Backend) -> None:
    """pricing="batch"|"auto": the backend's batch API must answer (asked from here, at
    submit, before anything is enqueued)."""
    client = await require_batch_client(backend, plan.backends, plan.pricing)
    await client.aclose()


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
    left = deadline_in(opts.deadline)  # "seconds from submit": counted from here
    if left is not None:  # in Redis's clock, which the workers route and hedge in
        try:
            sync_clock_blocking(client)
        except BaseException:
            client.close()
            raise
        plan.deadline_at = now_ms() / 1000 + left
    # max_server_waiting needs the servers' /metrics checked here, before anything is enqueued.
    if (plan.warm_prefix and plan.total > 1) or plan.max_server_waiting is not None \
            or plan.pricing != "sync":
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
