"""Submit a compiled batch to Redis + Celery, or re-attach to one.

The plan, every agent's state and the batch's bookkeeping are written in one MULTI/EXEC
transaction (pipelined in chunks), so a batch is either entirely in Redis or not at all.
Only then is one turn task per agent enqueued. If enqueueing is cut short, the recovery sweep
sends the missing turns once their progress deadline passes, so an accepted batch always
runs whole.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import redis

from ..backends.setup import open_backend, preflight_backend, warm_backend
from ..errors import BackendError, BackendUnavailable, BatchSpecError, ConfigError
from ..state.connection import mask_url, sync_client
from ..state.keys import ACTIVE_BATCHES, TOMBSTONE_S, BatchKeys
from ..state.redis_store import (
    DEFAULT_RETENTION_S,
    initial_meta,
    now_ms,
    retention_ms,
    sync_clock_blocking,
)
from ..state.retention import missing_error
from ..toolpool import resolve_tool
from ..workers.app import client_app
from ..workers.dispatch import publish, turn_message
from ..workers.settings import WorkerSettings
from .compile import CompiledBatch
from .distributed_handle import DistributedHandle
from .options import BatchOptions
from .plan import BatchPlan
from .runtime import import_object

log = logging.getLogger(__name__)
_CHUNK = 500


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
    except redis.AuthenticationError as exc:
        raise ConfigError(f"Redis at {mask_url(url)} refused the credentials: {exc}") from None
    except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
        raise ConfigError(f"cannot reach Redis at {mask_url(url)}: {exc}") from None
    return client


def write_batch(client: redis.Redis, plan: BatchPlan, compiled: CompiledBatch,
                grace_ms: int, retention_s: float = DEFAULT_RETENTION_S) -> None:
    """``retention_s`` travels with the batch (in ``meta``): the commit that finishes it sets
    that TTL on its keys."""
    k = BatchKeys(plan.batch_id)
    if client.exists(k.plan):
        raise BatchSpecError(f"a batch with id {plan.batch_id!r} already exists")
    sync_clock_blocking(client)  # deadlines in Redis's clock, like the workers'
    deadline = now_ms() + grace_ms
    with client.pipeline(transaction=True) as p:
        p.set(k.plan, plan.model_dump_json())
        p.hset(k.meta, mapping=initial_meta(plan, retention_s))
        states = compiled.states
        for start in range(0, len(states), _CHUNK):
            chunk = states[start : start + _CHUNK]
            p.hset(k.ver, mapping={s.index: s.version for s in chunk})
            p.hset(k.state, mapping={s.index: s.model_dump_json() for s in chunk})
            p.zadd(k.watch, {str(s.index): deadline for s in chunk})
        if states:
            p.sadd(ACTIVE_BATCHES, plan.batch_id)
        else:  # finished as written: no commit will ever set its retention
            keep = retention_ms(retention_s)
            p.pexpire(k.plan, keep)
            p.pexpire(k.meta, keep)
            p.set(k.gone, json.dumps({"reason": "expired", "finished_at_ms": now_ms(),
                                      "retention_ms": keep}), px=keep + TOMBSTONE_S * 1000)
        p.execute()


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
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise ConfigError(f"writing batch {plan.batch_id} to Redis at {mask_url(url)} failed; "
                          f"nothing was enqueued: {exc}") from None
    finally:
        client.close()
    messages = [turn_message(plan.batch_id, s, plan.max_turns) for s in compiled.states]
    try:
        publish(client_app(url), messages)
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
