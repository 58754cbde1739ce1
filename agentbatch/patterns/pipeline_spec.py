"""A chained pipeline's spec: what a worker needs to submit each stage after the one before.

A distributed ``run_with_reduce`` / ``run_with_map_reduce`` writes this JSON to Redis
(``PipelineKeys.spec``) before its first stage, and each stage batch names its pipeline and
stage in its plan; the commit that finishes a stage enqueues the task that submits the next
(``pipeline_chain.py``). So the submitter may die between stages. Stages are numbered: with a
planner, 0 is the plan and 1 the map; without, 0 is the map; then one stage per reduce level.
Tools and schemas travel as import paths, checked against the worker's allowlist
(``AGENTBATCH_WORKER_IMPORTS``) before anything is imported, as a plan's are.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import fields
from typing import Any, Literal

from pydantic import BaseModel

from agentbatch.core.errors import BatchSpecError
from agentbatch.core.import_allowlist import check_import_path, check_not_main
from agentbatch.core.options import BatchOptions
from agentbatch.core.tool import Tool
from agentbatch.turnloop.runtime import import_object
from agentbatch.turnloop.validate import check_batch_id

# Options a chained stage does not carry: the submitter's own (callbacks, display, its Redis
# URL: the worker uses its own), the stage's id (derived), what the distributed engine refuses.
_NOT_CHAINED = ("task", "inputs", "on_result", "progress", "metrics_port", "redis_url",
                "batch_id", "checkpoint_dir", "retry_failed")
_MAX_SUFFIX = len(".reduce999")


class StageSpec(BaseModel):
    """One kind of stage: its task template and its ``run_batch`` options, as JSON (tools
    and ``output_schema`` as import paths)."""

    task: str
    options: dict[str, Any]

    def import_paths(self) -> list[tuple[str, str, bool]]:
        """(what, path, nested) for every import this stage's batch makes."""
        tools = self.options.get("tools") or []
        out = [(f"tool {path!r}:", path, False) for path in tools]
        schema = self.options.get("output_schema")
        if schema:
            out.append(("output schema", schema, True))
        return out

    def batch_options(self, task: str, inputs: list[dict[str, Any]], *, redis_url: str,
                      batch_id: str) -> BatchOptions:
        """The stage's ``BatchOptions``, importing its schema (call ``check_imports`` first)."""
        opts = dict(self.options)
        if opts.get("output_schema"):
            opts["output_schema"] = import_object(opts["output_schema"])
        return BatchOptions(task, inputs, **opts, redis_url=redis_url, batch_id=batch_id,
                            progress=False)


class PipelineSpec(BaseModel):
    version: Literal[1] = 1
    pipeline_id: str
    plan: StageSpec | None = None  # the planner (run_with_map_reduce)
    items_field: str = "items"
    map: StageSpec
    reduce: StageSpec
    reduce_template: str
    fan_in: int | None = None
    context_tokens: int | None = None

    @property
    def map_stage(self) -> int:
        return 1 if self.plan is not None else 0

    def stage_name(self, n: int) -> str:
        if n < self.map_stage:
            return "plan"
        return "map" if n == self.map_stage else f"reduce{n - self.map_stage}"

    def batch_id(self, n: int) -> str:
        """Stage ``n``'s batch id: derived, so a second submit of it is refused as existing."""
        return f"{self.pipeline_id}.{self.stage_name(n)}"

    def check_imports(self, allowed: tuple[str, ...]) -> None:
        """Refuse any stage naming an import outside ``allowed``, before importing anything."""
        for stage in (self.plan, self.map, self.reduce):
            for what, path, nested in stage.import_paths() if stage else ():
                check_import_path(path, allowed, f"pipeline {self.pipeline_id}: {what}",
                                  nested=nested)


def check_pipeline_id(pipeline_id: Any) -> str:
    check_batch_id(pipeline_id)
    if len(pipeline_id) > 128 - _MAX_SUFFIX:
        raise BatchSpecError(f"batch_id must be at most {128 - _MAX_SUFFIX} characters here: "
                             "each stage's batch id adds a suffix to it")
    return pipeline_id


def _tool_path(tool: Any) -> str:
    if isinstance(tool, str):
        return tool
    if isinstance(tool, Tool) and tool.import_path:
        check_not_main(tool.import_path, "tool")
        return tool.import_path
    raise BatchSpecError(f"tools: {tool!r} cannot run in a chained pipeline: workers submit "
                         "the later stages, so each tool needs an import path (@tool at "
                         "module level)")


def _schema_path(schema: Any) -> str | None:
    if schema is None:
        return None
    if not (isinstance(schema, type) and issubclass(schema, BaseModel)):
        raise BatchSpecError(f"output_schema must be a Pydantic model class, got {schema!r}")
    path = f"{schema.__module__}:{schema.__qualname__}"
    if "<locals>" in path:
        raise BatchSpecError(f"output_schema {schema.__qualname__} cannot be loaded by "
                             "workers: it is defined inside a function; define it at module "
                             "level")
    check_not_main(path, "output_schema")
    return path


def resolved(task: str, inputs: Any, kwargs: Mapping[str, Any]) -> BatchOptions:
    """The options a ``run_batch(task, inputs, **kwargs)`` would run with (environment
    defaults filled in), without compiling."""
    from agentbatch.api import _options_for  # unknown keywords get the public "did you mean"

    return _options_for("run_batch", (task, inputs), dict(kwargs))


def stage_spec(task: str, kwargs: Mapping[str, Any]) -> StageSpec:
    """A stage's spec from its ``run_batch`` keywords (environment defaults resolved here, on
    the submitter, so every stage runs as the user's process would have run it)."""
    opts = resolved(task, [], kwargs)
    out: dict[str, Any] = {}
    for f in fields(BatchOptions):
        if f.name in _NOT_CHAINED:
            continue
        value = getattr(opts, f.name)
        if f.name == "tools":
            value = [_tool_path(t) for t in
                     (value if isinstance(value, list | tuple) else [value] if value else [])]
        elif f.name == "output_schema":
            value = _schema_path(value)
        elif isinstance(value, tuple):
            value = list(value)
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            raise BatchSpecError(f"{f.name}={value!r} cannot be carried to the workers that "
                                 "submit a chained pipeline's later stages (not JSON)") from None
        out[f.name] = value
    return StageSpec(task=task, options=out)
