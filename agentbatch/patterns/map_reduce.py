"""Plan -> map -> reduce: one planner agent lists items, one map agent per item, then a reduce.

Three kinds of batch in a row (the reduce may be a tree), each an ordinary ``run_batch``: so
both engines work, and each stage gets its own model. Everything that can be checked without
a model is checked before the planner runs, so bad input enqueues nothing.
"""

from __future__ import annotations

import asyncio
import typing
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from agentbatch.api import arun_batch, run_batch
from agentbatch.core.errors import BatchSpecError
from agentbatch.core.results import AgentResult
from agentbatch.patterns.pipeline_error import PipelineError
from agentbatch.patterns.reduce import (
    REDUCE_TASK,
    Reduced,
    ReduceSpec,
    areduce_levels,
    chained_url,
    reduce_levels,
)
from agentbatch.turnloop.compile import template_fields

ITEM_FIELD = "item"  # the task template's field for one plan item
_REDUCE_OPTIONS = ("reduce_backend", "reduce_tools", "reduce_fan_in", "reduce_context_tokens")


def _check_plan_schema(schema: Any, items_field: Any) -> str:
    if not isinstance(items_field, str) or not items_field.isidentifier():
        raise BatchSpecError(f"plan_items must be a field name, got {items_field!r}")
    if not (isinstance(schema, type) and issubclass(schema, BaseModel)):
        raise BatchSpecError(f"plan_output_schema must be a Pydantic model class, got {schema!r}")
    info = schema.model_fields.get(items_field)
    if info is None:
        have = ", ".join(schema.model_fields) or "no fields"
        raise BatchSpecError(
            f"plan_output_schema {schema.__name__} has no {items_field!r} field (it has "
            f"{have}); the plan's items must be a list[str] field: name it with plan_items=")
    ann = info.annotation
    args = typing.get_args(ann)
    inner = args[0] if len(args) == 1 else None
    if typing.get_origin(inner) is typing.Annotated:  # list[Annotated[str, Field(...)]]
        inner = typing.get_args(inner)[0]
    if typing.get_origin(ann) is not list or inner is not str:
        raise BatchSpecError(f"plan_output_schema {schema.__name__}.{items_field} must be "
                             f"list[str] (one map agent per string), got {ann!r}")
    return items_field


def _check_task(task: Any) -> None:
    if not isinstance(task, str):
        raise BatchSpecError(f"task must be a template string using {{{ITEM_FIELD}}}, got "
                             f"{type(task).__name__}")
    names = template_fields(task)
    if ITEM_FIELD not in names or len(names) > 1:
        other = [n for n in names if n != ITEM_FIELD]
        raise BatchSpecError(
            f"task is formatted with {{{ITEM_FIELD}}} (one plan item per map agent) and "
            f"nothing else; it " + (f"names {', '.join('{' + n + '}' for n in other)}"
                                    if other else f"does not use {{{ITEM_FIELD}}}"))


class _Pipeline:
    """The checked arguments of one plan -> map -> reduce, and each stage's batch options."""

    def __init__(self, plan_prompt: Any, plan_inputs: Any, plan_output_schema: Any, task: Any,
                 output_schema: Any, reduce: Any, reduce_schema: Any, planner_model: Any,
                 worker_model: Any, reducer_model: Any, plan_items: Any,
                 kwargs: dict[str, Any]) -> None:
        if not isinstance(plan_inputs, Mapping | BaseModel):
            raise BatchSpecError("plan_inputs must be one dict (or Pydantic model) for the "
                                 f"planner's prompt, got {type(plan_inputs).__name__}")
        self.items_field = _check_plan_schema(plan_output_schema, plan_items)
        _check_task(task)
        reduce_options = {k: kwargs.pop(k) for k in _REDUCE_OPTIONS if k in kwargs}
        model = kwargs.get("model")
        self.map_kwargs = {**kwargs, "output_schema": output_schema,
                           "model": worker_model or model}
        self.spec = ReduceSpec.build(reduce, reduce_schema, kwargs=self.map_kwargs,
                                     reduce_model=reducer_model or model,
                                     reduce_backend=reduce_options.get("reduce_backend"),
                                     reduce_tools=reduce_options.get("reduce_tools"),
                                     reduce_fan_in=reduce_options.get("reduce_fan_in"),
                                     reduce_context_tokens=reduce_options.get(
                                         "reduce_context_tokens"))
        self.plan_args = (plan_prompt, [plan_inputs])
        self.plan_kwargs = {k: v for k, v in kwargs.items() if k != "on_result"}
        self.plan_kwargs.update(output_schema=plan_output_schema, model=planner_model or model)
        if kwargs.get("batch_id"):
            self.plan_kwargs["batch_id"] = f"{kwargs['batch_id']}.plan"
        self.task = task

    def map_inputs(self, planned: list[AgentResult]) -> list[dict[str, str]]:
        return plan_map_inputs(planned, self.items_field)


def plan_map_inputs(planned: list[AgentResult], items_field: str) -> list[dict[str, str]]:
    """One map input per plan item; a failed planner or an empty plan ends here. The plan's
    output may be the schema instance or its dict (a worker chaining the stages)."""
    [plan] = planned
    if not plan.ok:
        kind, message = (plan.error.kind, plan.error.message) if plan.error else ("?", "")
        raise PipelineError(f"the planner failed ({kind}: {message}); no map stage ran",
                            stage="plan", results=planned)
    out = plan.output
    items = out.get(items_field) if isinstance(out, dict) else getattr(out, items_field, None)
    if not items:
        raise PipelineError(f"the plan's {items_field!r} is empty; no map stage ran",
                            stage="plan", results=planned)
    return [{ITEM_FIELD: item} for item in items]


def _chained(p: _Pipeline, url: str) -> tuple[list[AgentResult], Reduced]:
    """Distributed: the workers chain plan -> map -> reduce (``pipeline_chain.py``); this
    process submits the planner and waits on the pipeline. ``on_result`` sees the map
    results when the pipeline is done."""
    from agentbatch.patterns.pipeline_handle import new_pipeline_id, start_pipeline
    from agentbatch.patterns.pipeline_spec import PipelineSpec, check_pipeline_id, stage_spec

    pid = check_pipeline_id(new_pipeline_id(p.map_kwargs.get("batch_id")))
    plan_task, plan_inputs = p.plan_args
    pipeline = PipelineSpec(pipeline_id=pid, plan=stage_spec(plan_task, p.plan_kwargs),
                            items_field=p.items_field, map=stage_spec(p.task, p.map_kwargs),
                            reduce=stage_spec(REDUCE_TASK, p.spec.stage_kwargs(1)),
                            reduce_template=p.spec.template, fan_in=p.spec.fan_in,
                            context_tokens=p.spec.context_tokens)
    with start_pipeline(pipeline, plan_task, list(plan_inputs), url) as handle:
        mapped, reduced = handle.wait()
    on_result = p.map_kwargs.get("on_result")
    if on_result is not None:
        for result in mapped:
            on_result(result)
    return mapped, reduced


def run_with_map_reduce(
    plan_prompt: str,
    plan_inputs: Mapping[str, Any] | BaseModel,
    plan_output_schema: type[BaseModel],
    task: str,
    output_schema: type[BaseModel] | None,
    reduce: str,
    reduce_schema: type[BaseModel],
    *,
    planner_model: str | None = None,
    worker_model: str | None = None,
    reducer_model: str | None = None,
    plan_items: str = "items",
    **kwargs: Any,
) -> tuple[list[AgentResult], Reduced]:
    """Plan, map, reduce; return ``(map_results, reduced)``.

    One planner agent renders ``plan_prompt`` with ``plan_inputs`` and answers
    ``plan_output_schema``, whose ``items: list[str]`` field (or the one ``plan_items``
    names) lists the work. ``task`` is formatted with ``{item}`` for each item: one map agent
    per item, its result's ``input`` is ``{"item": <the item>}``. Then ``run_with_reduce``'s
    reduce over the map results (``reduce`` template, ``reduce_schema``, and its
    ``reduce_backend`` / ``reduce_tools`` / ``reduce_fan_in`` / ``reduce_context_tokens``).

    Every other keyword is ``run_batch``'s and applies to every stage (``redis_url`` makes
    each stage a distributed batch); ``planner_model`` / ``worker_model`` /
    ``reducer_model`` override ``model`` per stage. ``on_result`` sees map results only.

    Returns:
        ``map_results`` in plan order, and ``reduced``: a ``reduce_schema`` instance when the
        reduce agent succeeded, else its ``AgentResult`` carrying the error.

    Raises:
        BatchSpecError: bad arguments (a plan schema without the items field, a task without
            ``{item}``, a reduce template naming an unknown field...), before anything runs.
        PipelineError: ``stage="plan"`` when the planner failed or planned no items (no map
            stage ran; the planner's result is on ``results``), or a reduce-stage error as in
            ``run_with_reduce``.
    """
    p = _Pipeline(plan_prompt, plan_inputs, plan_output_schema, task, output_schema, reduce,
                  reduce_schema, planner_model, worker_model, reducer_model, plan_items, kwargs)
    url = chained_url(kwargs)
    if url:
        return _chained(p, url)
    inputs = p.map_inputs(run_batch(*p.plan_args, **p.plan_kwargs))
    mapped = run_batch(p.task, inputs, **p.map_kwargs)
    return mapped, reduce_levels(p.spec, mapped)


async def arun_with_map_reduce(
    plan_prompt: str,
    plan_inputs: Mapping[str, Any] | BaseModel,
    plan_output_schema: type[BaseModel],
    task: str,
    output_schema: type[BaseModel] | None,
    reduce: str,
    reduce_schema: type[BaseModel],
    *,
    planner_model: str | None = None,
    worker_model: str | None = None,
    reducer_model: str | None = None,
    plan_items: str = "items",
    **kwargs: Any,
) -> tuple[list[AgentResult], Reduced]:
    """Async ``run_with_map_reduce`` (same arguments and contract)."""
    p = _Pipeline(plan_prompt, plan_inputs, plan_output_schema, task, output_schema, reduce,
                  reduce_schema, planner_model, worker_model, reducer_model, plan_items, kwargs)
    url = chained_url(kwargs)
    if url:
        return await asyncio.to_thread(_chained, p, url)
    inputs = p.map_inputs(await arun_batch(*p.plan_args, **p.plan_kwargs))
    mapped = await arun_batch(p.task, inputs, **p.map_kwargs)
    return mapped, await areduce_levels(p.spec, mapped)
