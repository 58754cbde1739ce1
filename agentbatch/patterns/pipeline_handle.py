"""Start a chained pipeline from the submitter, and follow one from any process.

``start_pipeline`` writes the spec (created only if absent: staged, then RENAMENX, the only
way the submitter's Redis user may create it) and submits the first stage; workers chain the
rest (``pipeline_chain.py``). ``PipelineHandle`` (``get_pipeline``) shows each stage's
progress and returns ``(map_results, reduced)`` once the pipeline's ``done`` record is there.
A waiting handle also re-sends the 'stage finished' task when a stage has finished and
nothing followed for ``stall_s`` (the worker that took the task died: task messages are not
redelivered), which the chain's guards make harmless if it was merely slow.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from agentbatch.core.errors import BatchSpecError
from agentbatch.core.output import OutputContract
from agentbatch.core.results import AgentResult
from agentbatch.distributed.state.connection import mask_url, sync_client
from agentbatch.distributed.state.keys import BatchKeys, PipelineKeys
from agentbatch.distributed.state.redis_store import retention_ms
from agentbatch.distributed.workers.app import (
    INFERENCE_QUEUE,
    PIPELINE_TASK,
    PRIORITY_STEPS,
    client_app,
)
from agentbatch.distributed.workers.dispatch import Followup, publish
from agentbatch.distributed.workers.settings import WorkerSettings
from agentbatch.patterns.pipeline_chain import stage_batch, stage_of, stage_results, submit_stage
from agentbatch.patterns.pipeline_error import PipelineError
from agentbatch.patterns.pipeline_spec import PipelineSpec, check_pipeline_id
from agentbatch.turnloop.runtime import import_object

log = logging.getLogger(__name__)
POLL_S = 0.5
STALL_S = 60.0  # a finished stage with nothing after it this long: re-send 'stage finished'
MAX_RESENDS = 3


@dataclass
class StageProgress:
    name: str
    batch_id: str
    submitted: bool
    total: int = 0
    delivered: int = 0
    finished: bool = False


@dataclass
class PipelineProgress:
    """Where a pipeline is: its stages so far (``stage`` is the last submitted) and, once
    ``done``, the ``error`` that ended it early, if any."""

    pipeline_id: str
    stage: str
    stages: list[StageProgress] = field(default_factory=list)
    done: bool = False
    error: str | None = None


def _load(path: str | None) -> type[BaseModel] | None:
    if not path:
        return None
    try:
        return import_object(path)
    except Exception:
        log.info("schema %s not importable here; outputs stay dicts", path)
        return None


class PipelineHandle:
    def __init__(self, pipeline_id: str, redis_url: str) -> None:
        self.pipeline_id = pipeline_id
        self.redis_url = redis_url
        self.keys = PipelineKeys(pipeline_id)
        self._client = sync_client(redis_url)
        raw = self._client.get(self.keys.spec)
        if raw is None:
            self._client.close()
            raise BatchSpecError(f"no pipeline {pipeline_id!r} in Redis at {mask_url(redis_url)}"
                                 " (never started, or past its retention)")
        self.spec = PipelineSpec.model_validate_json(raw)

    def _stage(self, n: int) -> StageProgress:
        batch_id = self.spec.batch_id(n)
        meta = self._client.hgetall(BatchKeys(batch_id).meta)
        return StageProgress(self.spec.stage_name(n), batch_id, bool(meta),
                             int(meta.get("total", 0)), int(meta.get("delivered", 0)),
                             meta.get("finished") == "1")

    def progress(self) -> PipelineProgress:
        """Every stage submitted so far, with its counts (a few Redis reads per stage)."""
        stages, n = [], 0
        while True:
            s = self._stage(n)
            if not s.submitted:
                break
            stages.append(s)
            n += 1
        raw = self._client.get(self.keys.done)
        done = json.loads(raw) if raw else None
        return PipelineProgress(self.pipeline_id, stages[-1].name if stages else "none",
                                stages, done is not None, (done or {}).get("error"))

    def _resend(self, stage: int) -> None:
        publish(client_app(self.redis_url), [Followup(
            PIPELINE_TASK, (self.pipeline_id, stage), INFERENCE_QUEUE, PRIORITY_STEPS[0])])

    def wait(self, timeout: float | None = None, *, stall_s: float = STALL_S
             ) -> tuple[list[AgentResult], BaseModel | AgentResult]:
        """``(map_results, reduced)`` once the pipeline is done (``run_with_reduce``'s
        contract); ``PipelineError`` if a stage could not feed the next; ``TimeoutError``
        after ``timeout`` s; ``PipelineError`` when a finished stage is followed by nothing
        after ``MAX_RESENDS`` re-sends ``stall_s`` apart."""
        deadline = None if timeout is None else time.monotonic() + timeout
        last, since, resends = None, time.monotonic(), 0
        while True:
            raw = self._client.get(self.keys.done)
            if raw:
                return self._outcome(json.loads(raw))
            p = self.progress()
            now = time.monotonic()
            if not p.stages:
                if now - since > stall_s or (deadline is not None and now > deadline):
                    raise BatchSpecError(f"pipeline {self.pipeline_id}: its first stage was "
                                         "never submitted (the submitter stopped before it)")
                time.sleep(POLL_S)
                continue
            head = (len(p.stages), p.stages[-1].delivered, p.stages[-1].finished)
            if head != last:
                last, since = head, now
            elif p.stages[-1].finished and now - since > stall_s:
                if resends >= MAX_RESENDS:
                    raise PipelineError(f"stage {p.stages[-1].name} finished but nothing "
                                        f"followed after {resends} re-sends", stage="chain",
                                        results=[])
                log.warning("pipeline %s: stage %s finished %.0f s ago and nothing followed; "
                            "re-sending its 'stage finished' task", self.pipeline_id,
                            p.stages[-1].name, now - since)
                self._resend(len(p.stages) - 1)
                resends, since = resends + 1, now
            if deadline is not None and now > deadline:
                raise TimeoutError(f"pipeline {self.pipeline_id}: not done within {timeout}s "
                                   f"(at stage {p.stage})")
            time.sleep(POLL_S)

    def _results(self, n: int) -> list[AgentResult]:
        """Stage ``n``'s results in input order, outputs as its schema where importable."""
        contract = OutputContract(_load(stage_of(self.spec, n).options.get("output_schema")))
        return [r.model_copy(update={"output": contract.instance(r.output)})
                if r.ok and contract.schema is not None and isinstance(r.output, dict) else r
                for r in stage_results(self._client, self.spec.batch_id(n))]

    def _outcome(self, done: dict[str, Any]) -> tuple[list[AgentResult],
                                                       BaseModel | AgentResult]:
        stage = int(done["stage"])
        if "error" in done:
            raise PipelineError(done["error"], stage=done.get("kind", "chain"),
                                results=self._results(min(stage, self.spec.map_stage)))
        mapped = self._results(self.spec.map_stage)
        [final] = self._results(stage)
        return mapped, final.output if final.ok else final

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> PipelineHandle:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def get_pipeline(pipeline_id: str, *, redis_url: str | None = None) -> PipelineHandle:
    """Re-attach to a distributed ``run_with_reduce`` / ``run_with_map_reduce`` (its
    ``batch_id``) from any process: a ``PipelineHandle`` with ``progress()`` and
    ``wait(timeout)`` -> ``(map_results, reduced)``."""
    check_pipeline_id(pipeline_id)
    url = redis_url or os.environ.get("AGENTBATCH_REDIS_URL")
    if not url:
        raise BatchSpecError("get_pipeline needs redis_url (or AGENTBATCH_REDIS_URL)")
    return PipelineHandle(pipeline_id, url)


def new_pipeline_id(batch_id: str | None) -> str:
    return batch_id or f"pipe-{uuid.uuid4().hex}"


def start_pipeline(spec: PipelineSpec, task: str, inputs: list[Any],
                   redis_url: str, **extra: Any) -> PipelineHandle:
    """Write ``spec`` (refused when the pipeline exists) and submit stage 0."""
    keep = retention_ms(WorkerSettings.from_env(redis_url).retention_s)
    prepared = stage_batch(spec, 0, task, inputs, redis_url, **extra)  # bad input: no spec
    pk = PipelineKeys(spec.pipeline_id)
    client = sync_client(redis_url)
    try:
        staged = pk.staged_spec(uuid.uuid4().hex)
        client.set(staged, spec.model_dump_json(), px=keep)
        if not client.renamenx(staged, pk.spec):
            client.unlink(staged)
            raise BatchSpecError(f"a pipeline with id {spec.pipeline_id!r} already exists")
    finally:
        client.close()
    if not submit_stage(spec, 0, task, inputs, redis_url, prepared):
        raise BatchSpecError(f"a batch with id {spec.batch_id(0)!r} already exists")
    return PipelineHandle(spec.pipeline_id, redis_url)
