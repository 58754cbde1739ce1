"""Worker side of a chained pipeline: when a stage batch finishes, submit the next stage.

The commit that finishes a stage batch pushes one ``agentbatch.pipeline_stage`` task in the
same script (``commit.lua``'s ``on_finish``). Its worker reads the finished stage's results,
builds the next stage's inputs (the plan's items, or one reduce level's prompts) and submits
it under a batch id derived from the pipeline and stage, so it runs once however often the
task is delivered: a ``SET NX`` guard on ``ab:pipe:{id}:stage:{n}`` turns duplicates away
cheaply, and ``submit.lua`` refuses a second batch with the same id (what makes it exact even
when the worker that took the guard died before submitting). The last stage, or a stage that
cannot feed the next (an empty plan, a reduce prompt over the context), writes the
pipeline's ``done`` record, which ``PipelineHandle`` reads.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from typing import Any

import redis

from agentbatch.core.errors import BatchSpecError
from agentbatch.core.options import BatchOptions
from agentbatch.core.results import AgentResult
from agentbatch.distributed.state.connection import sync_client
from agentbatch.distributed.state.keys import BatchKeys, PipelineKeys
from agentbatch.distributed.state.redis_store import DEFAULT_RETENTION_S, retention_ms
from agentbatch.distributed.state.replies import range_entries
from agentbatch.patterns.map_reduce import plan_map_inputs
from agentbatch.patterns.pipeline_error import PipelineError
from agentbatch.patterns.pipeline_spec import PipelineSpec, StageSpec
from agentbatch.patterns.reduce import REDUCE_TASK, ReduceSpec
from agentbatch.turnloop.compile import CompiledBatch, compile_batch
from agentbatch.turnloop.runtime import import_object

log = logging.getLogger(__name__)


def stage_results(client: redis.Redis, batch_id: str) -> list[AgentResult]:
    """A finished batch's results in input order (one per agent: a result written twice
    after a failover counts once), read from its stream."""
    by_index: dict[int, AgentResult] = {}
    for _, fields in range_entries(client.xrange(BatchKeys(batch_id).results)):
        result = AgentResult.model_validate_json(fields["r"])
        by_index.setdefault(result.index, result)
    return [by_index[i] for i in sorted(by_index)]


def stage_of(spec: PipelineSpec, n: int) -> StageSpec:
    if n < spec.map_stage:
        assert spec.plan is not None
        return spec.plan
    return spec.map if n == spec.map_stage else spec.reduce


def stage_batch(spec: PipelineSpec, n: int, task: str, inputs: list[Any], redis_url: str,
                **extra: Any) -> tuple[CompiledBatch, BatchOptions]:
    """Stage ``n`` compiled (checked, nothing written), its plan naming pipeline and stage."""
    opts = stage_of(spec, n).batch_options(task, inputs, redis_url=redis_url,
                                           batch_id=spec.batch_id(n))
    if extra:
        opts = replace(opts, **extra)
    compiled = compile_batch(opts)
    compiled.plan = compiled.plan.model_copy(
        update={"pipeline_id": spec.pipeline_id, "pipeline_stage": n})
    return compiled, opts


def submit_stage(spec: PipelineSpec, n: int, task: str, inputs: list[Any], redis_url: str,
                 prepared: tuple[CompiledBatch, BatchOptions] | None = None) -> bool:
    """Submit stage ``n`` (``prepared`` by ``stage_batch``, or built here); False when that
    batch exists already (another delivery submitted it)."""
    from agentbatch.distributed.submit import submit_distributed

    compiled, opts = prepared or stage_batch(spec, n, task, inputs, redis_url)
    try:
        handle = submit_distributed(compiled, opts)
    except BatchSpecError as exc:
        if "already exists" in str(exc):
            return False
        raise
    handle.close()
    return True


def next_inputs(spec: PipelineSpec, stage: int, results: list[AgentResult]
                ) -> tuple[str, list[dict[str, Any]]] | None:
    """The task and inputs of stage ``stage + 1``, or None when ``stage`` was the last (a
    reduce level that left one result). Raises ``PipelineError`` when it cannot run."""
    if stage < spec.map_stage:
        return spec.map.task, plan_map_inputs(results, spec.items_field)
    level = stage - spec.map_stage  # 0: the map just finished
    if level >= 1 and len(results) == 1:
        return None
    schema = import_object(spec.reduce.options["output_schema"])
    reducer = ReduceSpec(spec.reduce_template, schema, spec.fan_in, spec.context_tokens,
                         kwargs=spec.reduce.options)
    prompts = reducer.level_prompts(results, level + 1, [])
    return REDUCE_TASK, [{"reduce_prompt": p} for p in prompts]


def _end(client: redis.Redis, spec: PipelineSpec, stage: int, keep_ms: int,
         error: PipelineError | BatchSpecError | None = None) -> None:
    """Write the pipeline's ``done`` record (once) and give its keys the retention."""
    pk = PipelineKeys(spec.pipeline_id)
    record: dict[str, Any] = {"stage": stage}
    if error is not None:
        kind = getattr(error, "stage", "chain")
        record.update(error=str(error).removeprefix(f"{kind} stage: "), kind=kind)
    client.set(pk.done, json.dumps(record), px=keep_ms, nx=True)
    client.pexpire(pk.spec, keep_ms)
    for n in range(stage + 1):
        client.pexpire(pk.stage(n), keep_ms)


def stage_finished(redis_url: str, allowed: tuple[str, ...], pipeline_id: str,
                   stage: int) -> str:
    """Submit the stage after ``stage`` (once), or end the pipeline; returns what it did
    ("submitted", "duplicate", "done", "failed", "refused", "gone"), for the log and tests."""
    client = sync_client(redis_url)
    try:
        return _stage_finished(client, redis_url, allowed, pipeline_id, stage)
    finally:
        client.close()


def _stage_finished(client: redis.Redis, redis_url: str, allowed: tuple[str, ...],
                    pipeline_id: str, stage: int) -> str:
    pk = PipelineKeys(pipeline_id)
    raw = client.get(pk.spec)
    if raw is None:
        log.warning("pipeline %s: stage %d finished but the pipeline's spec is gone", pipeline_id,
                    stage)
        return "gone"
    spec = PipelineSpec.model_validate_json(raw)
    if client.exists(pk.done):
        return "duplicate"
    meta_keep = client.hget(BatchKeys(spec.batch_id(stage)).meta, "retention_ms")
    keep_ms = int(meta_keep) if meta_keep else retention_ms(DEFAULT_RETENTION_S)
    try:
        spec.check_imports(allowed)  # before anything of the spec is imported
    except BatchSpecError as exc:
        log.error("pipeline %s refused: %s", pipeline_id, exc)
        _end(client, spec, stage, keep_ms, exc)
        return "refused"
    results = stage_results(client, spec.batch_id(stage))
    try:
        step = next_inputs(spec, stage, results)
    except PipelineError as exc:
        _end(client, spec, stage, keep_ms, exc)
        return "failed"
    if step is None:
        _end(client, spec, stage, keep_ms)
        return "done"
    n = stage + 1
    if not client.set(pk.stage(n), spec.batch_id(n), nx=True, px=keep_ms) and \
            client.exists(BatchKeys(spec.batch_id(n)).plan):
        return "duplicate"  # a guard whose batch is missing: its worker died; submit.lua decides
    client.pexpire(pk.spec, keep_ms)
    try:
        submitted = submit_stage(spec, n, *step, redis_url)
    except BatchSpecError as exc:
        log.error("pipeline %s: stage %s was refused: %s", pipeline_id, spec.stage_name(n), exc)
        _end(client, spec, stage, keep_ms, exc)
        return "refused"
    return "submitted" if submitted else "duplicate"
