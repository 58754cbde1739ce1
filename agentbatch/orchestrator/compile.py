"""Validate a batch and compile it into a plan plus initial agent states.

Every check that can fail runs here, before anything is sent or enqueued, and names the
offending input index where one applies.
"""

from __future__ import annotations

import inspect
import string
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from ..backends.setup import expand_backend_urls
from ..backends.urls import parse_backend_url
from ..errors import BatchSpecError
from ..toolpool import Tool, resolve_tool
from .agent_state import AgentState
from .options import BatchOptions
from .output import OutputContract
from .plan import BatchPlan, ToolRef


@dataclass
class CompiledBatch:
    plan: BatchPlan
    states: list[AgentState]
    tools: list[Tool]
    contract: OutputContract


def template_fields(task: str) -> list[str]:
    """Top-level names a ``str.format`` template refers to (``{a.b}`` needs ``a``)."""
    try:
        parsed = list(string.Formatter().parse(task))
    except ValueError as exc:
        raise BatchSpecError(f"task template is not a valid format string: {exc}") from None
    names: list[str] = []
    for _, field_name, _, _ in parsed:
        if field_name is None:
            continue
        root = field_name.split(".", 1)[0].split("[", 1)[0]
        if root == "" or root.isdigit():
            raise BatchSpecError(
                "task template uses positional fields like '{}' or '{0}'; "
                "name them after input keys, e.g. '{path}'"
            )
        if root not in names:
            names.append(root)
    return names


def render_prompt(task: str, fields: list[str], item: Mapping[str, Any], index: int) -> str:
    missing = [f for f in fields if f not in item]
    if missing:
        have = ", ".join(sorted(map(str, item))) or "no keys"
        raise BatchSpecError(
            f"template variable(s) {', '.join(repr(m) for m in missing)} missing "
            f"(the input has {have})",
            index=index,
        )
    try:
        return task.format(**item)
    except (KeyError, IndexError, AttributeError, ValueError) as exc:
        raise BatchSpecError(f"task template could not be rendered: {exc!r}", index=index) \
            from None


def _coerce_input(item: Any, index: int) -> dict[str, Any]:
    if isinstance(item, BaseModel):
        return item.model_dump(mode="json")
    if isinstance(item, Mapping):
        return dict(item)
    raise BatchSpecError(f"each input must be a dict, got {type(item).__name__}", index=index)


def _resolve_tools(tools: Any) -> list[Tool]:
    if isinstance(tools, str | Tool) or callable(tools):
        tools = [tools]
    resolved: list[Tool] = []
    for i, obj in enumerate(tools or ()):
        try:
            resolved.append(resolve_tool(obj))
        except BatchSpecError as exc:
            raise BatchSpecError(f"tools[{i}]: {exc}") from None
    names = [t.name for t in resolved]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise BatchSpecError(f"tool names must be unique; repeated: {', '.join(dupes)}")
    return resolved


def _check_schema(schema: Any) -> None:
    if schema is None:
        return
    if not (inspect.isclass(schema) and issubclass(schema, BaseModel)):
        raise BatchSpecError(
            f"output_schema must be a Pydantic model class (a BaseModel subclass) or None, "
            f"got {schema!r}"
        )


def _check_limits(opts: BatchOptions) -> None:
    if opts.checkpoint_dir is not None:
        raise BatchSpecError("checkpoint_dir is not supported yet (checkpoint/resume of the "
                             "embedded engine is planned); use the distributed engine "
                             "(redis_url=...) for batches that must survive a crash")
    if not isinstance(opts.max_turns, int) or opts.max_turns < 1:
        raise BatchSpecError(f"max_turns must be an integer >= 1, got {opts.max_turns!r}")
    if not isinstance(opts.max_retries, int) or opts.max_retries < 0:
        raise BatchSpecError(f"max_retries must be an integer >= 0, got {opts.max_retries!r}")
    if opts.max_inflight is not None and (
        not isinstance(opts.max_inflight, int) or opts.max_inflight < 1
    ):
        raise BatchSpecError(f"max_inflight must be an integer >= 1, got {opts.max_inflight!r}")
    for name in ("timeout_per_turn", "timeout_per_tool"):
        value = getattr(opts, name)
        if value is not None and not (isinstance(value, int | float) and value > 0):
            raise BatchSpecError(f"{name} must be a positive number of seconds or None")
    if not isinstance(opts.task, str) or not opts.task.strip():
        raise BatchSpecError("task must be a non-empty template string")
    if not isinstance(opts.model, str) or not opts.model:
        raise BatchSpecError("model must be a non-empty string")


def _backends(backend: Any) -> list[str]:
    urls = [backend] if isinstance(backend, str) else list(backend or ())
    if not urls:
        raise BatchSpecError("backend must be a URL or a non-empty list of URLs")
    for url in urls:
        if not isinstance(url, str):
            raise BatchSpecError(f"backend URLs must be strings, got {url!r}")
    try:
        expanded = expand_backend_urls(urls)
    except OSError as exc:
        raise BatchSpecError(f"backend hostfile could not be read: {exc}") from None
    if not expanded:
        raise BatchSpecError("the backend hostfile lists no endpoints")
    for url in expanded:
        parse_backend_url(url)
    return urls


def schema_import_path(schema: type[BaseModel] | None) -> str | None:
    if schema is None or "<locals>" in schema.__qualname__:
        return None
    return f"{schema.__module__}:{schema.__qualname__}"


def system_message(system_prompt: str | None, contract: OutputContract) -> str:
    parts = [p for p in (system_prompt or "", contract.instructions()) if p]
    return "\n\n".join(parts) or "You are a helpful assistant."


def compile_batch(opts: BatchOptions) -> CompiledBatch:
    """Check everything, then build the plan and one state per input."""
    _check_limits(opts)
    _check_schema(opts.output_schema)
    backends = _backends(opts.backend)
    tools = _resolve_tools(opts.tools)
    if isinstance(opts.inputs, Mapping | str | bytes):
        raise BatchSpecError("inputs must be a list of dicts, one per agent")
    items = [_coerce_input(item, i) for i, item in enumerate(opts.inputs)]
    fields = template_fields(opts.task)
    prompts = [render_prompt(opts.task, fields, item, i) for i, item in enumerate(items)]
    contract = OutputContract(opts.output_schema)
    plan = BatchPlan(
        batch_id=opts.batch_id or uuid.uuid4().hex[:16],
        total=len(items),
        model=opts.model,
        backends=backends,
        system_message=system_message(opts.system_prompt, contract),
        tool_refs=[ToolRef(name=t.name, import_path=t.import_path) for t in tools],
        tool_schemas=[t.openai_schema() for t in tools],
        output_schema_path=schema_import_path(opts.output_schema),
        output_schema_name=contract.name,
        output_json_schema=contract.json_schema,
        max_turns=opts.max_turns,
        max_retries=opts.max_retries,
        max_inflight=opts.max_inflight,
        timeout_per_turn=opts.timeout_per_turn,
        timeout_per_tool=opts.timeout_per_tool,
        max_tokens=opts.max_tokens,
        temperature=opts.temperature,
        native_json_schema=opts.native_json_schema,
        warm_prefix=opts.warm_prefix,
        batch_prompting=opts.batch_prompting,
        max_server_waiting=opts.max_server_waiting,
        created_at=time.time(),
    )
    states = [
        AgentState(index=i, input=item, messages=[{"role": "user", "content": prompt}])
        for i, (item, prompt) in enumerate(zip(items, prompts, strict=True))
    ]
    return CompiledBatch(plan=plan, states=states, tools=tools, contract=contract)
