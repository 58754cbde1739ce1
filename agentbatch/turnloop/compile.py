"""Validate a batch and compile it into a plan plus initial agent states.

Every check that can fail runs here, before anything is sent or enqueued: the parameters
and inputs first (``validate``), then what only compiling can find (a template field an input
lacks, a tool path that does not import, a backend URL that does not parse).
"""

from __future__ import annotations

import json
import re
import string
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from agentbatch.backends.setup import check_batch_prompting, expand_backend_urls
from agentbatch.backends.urls import parse_backend_url
from agentbatch.core.agent_state import AgentState
from agentbatch.core.errors import BatchSpecError
from agentbatch.core.options import BatchOptions
from agentbatch.core.output import OutputContract
from agentbatch.core.plan import BatchPlan, ToolRef
from agentbatch.core.pricing import load_prices
from agentbatch.toolpool import Tool, resolve_tool
from agentbatch.turnloop.json_tool_calling import instructions as json_instructions
from agentbatch.turnloop.json_tool_calling import mode_for_backends
from agentbatch.turnloop.tool_choice import check_backends as check_tool_choice_backends
from agentbatch.turnloop.validate import check_inputs, check_options, check_pool, check_tools


@dataclass
class CompiledBatch:
    plan: BatchPlan
    states: list[AgentState]
    tools: list[Tool]
    contract: OutputContract


MAX_FORMAT_WIDTH = 256  # the largest width or precision a task template's field may ask for
# str.format's mini-language: [[fill]align][sign][z][#][0][width][grouping][.precision][type]
_FORMAT_SPEC = re.compile(r"(?:.?[<>=^])?[-+ ]?z?#?0?(\d*)[_,]?(?:\.(\d+))?[a-zA-Z%]?", re.S)


def _check_field(field_name: str, spec: str, conversion: str | None) -> None:
    """A task template field is a plain name: ``{x.__class__.__mro__}`` would reach any
    object from an input, and ``{x:>99999999}`` build a 100 MB prompt per agent."""
    shown = "{" + field_name + (f"!{conversion}" if conversion else "") + \
        (f":{spec}" if spec else "") + "}"
    if not field_name.isidentifier():
        raise BatchSpecError(
            f"task template field {shown}: only plain fields are allowed, like "
            f"{{{field_name.split('.', 1)[0].split('[', 1)[0] or 'x'}}} (no attribute access or "
            "indexing: put the value you need in the input itself)")
    match = _FORMAT_SPEC.fullmatch(spec)
    sizes = [int(n) for n in (match.groups() if match else ()) if n]
    if match is None or any(n > MAX_FORMAT_WIDTH for n in sizes):
        raise BatchSpecError(
            f"task template field {shown}: a format spec may not nest fields or ask for a "
            f"width or precision above {MAX_FORMAT_WIDTH}; use {{{field_name}}} "
            "and format the value in the input")


def template_fields(task: str) -> list[str]:
    """The names a ``str.format`` template refers to; each field must be a plain name."""
    try:
        parsed = list(string.Formatter().parse(task))
    except ValueError as exc:
        raise BatchSpecError(f"task template is not a valid format string: {exc}") from None
    names: list[str] = []
    for _, field_name, spec, conversion in parsed:
        if field_name is None:
            continue
        root = field_name.split(".", 1)[0].split("[", 1)[0]
        if root == "" or root.isdigit():
            raise BatchSpecError(
                "task template uses positional fields like '{}' or '{0}'; "
                "name them after input keys, e.g. '{path}'"
            )
        _check_field(field_name, spec or "", conversion)
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


def _resolve_tools(tools: Any) -> list[Tool]:
    resolved: list[Tool] = []
    for i, obj in enumerate(check_tools(tools)):
        try:
            resolved.append(resolve_tool(obj))
        except BatchSpecError as exc:
            raise BatchSpecError(f"tools[{i}]: {exc}") from None
    names = [t.name for t in resolved]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise BatchSpecError(f"tool names must be unique; repeated: {', '.join(dupes)}")
    return resolved


def _backends(backend: Any) -> list[str]:
    urls = [backend] if isinstance(backend, str) else list(backend)
    try:
        expanded = expand_backend_urls(urls)
    except OSError as exc:
        raise BatchSpecError(f"backend hostfile could not be read: {exc}") from None
    if not expanded:
        raise BatchSpecError("the backend hostfile lists no endpoints")
    targets = [parse_backend_url(url) for url in expanded]
    if len(targets) > 1:
        check_pool(targets)
    return urls


def schema_import_path(schema: type[BaseModel] | None) -> str | None:
    if schema is None or "<locals>" in schema.__qualname__:
        return None
    return f"{schema.__module__}:{schema.__qualname__}"


def shows_schema(text: str | None, schema: dict[str, Any] | None) -> bool:
    """``text`` already holds ``schema`` as a JSON object (in any spacing or key order).

    A system prompt that pastes the output schema must not get a second copy: the model
    would read every field twice, and the shared prefix would grow by the schema's size.
    """
    if not text or schema is None:
        return False
    names = schema.get("properties") or {}
    if not all(f'"{name}"' in text for name in names):
        return False  # cheap: a JSON copy of the schema quotes every field name
    decoder = json.JSONDecoder()
    start = text.find("{")
    while start != -1:
        try:
            value, end = decoder.raw_decode(text, start)
        except (ValueError, RecursionError):
            start = text.find("{", start + 1)
            continue
        if value == schema:
            return True
        start = text.find("{", end if end > start else start + 1)
    return False


def system_message(system_prompt: str | None, contract: OutputContract) -> str:
    shown = shows_schema(system_prompt, contract.json_schema)
    parts = [p for p in (system_prompt or "", "" if shown else contract.instructions()) if p]
    return "\n\n".join(parts) or "You are a helpful assistant."


def compile_batch(opts: BatchOptions) -> CompiledBatch:
    """Check everything, then build the plan and one state per input."""
    check_options(opts)
    items = check_inputs(opts.inputs)
    backends = _backends(opts.backend)
    tools = _resolve_tools(opts.tools)
    fields = template_fields(opts.task)
    prompts = [render_prompt(opts.task, fields, item, i) for i, item in enumerate(items)]
    contract = OutputContract(opts.output_schema)
    tool_calling = mode_for_backends(opts.tool_calling, backends, has_tools=bool(tools),
                                     native_json_schema=opts.native_json_schema)
    check_tool_choice_backends(opts.tool_choice, tool_calling, backends)
    if opts.batch_prompting:  # json-mode tool turns are plain text: those can be batched
        check_batch_prompting(backends, has_tools=bool(tools) and tool_calling != "json")
    system = system_message(opts.system_prompt, contract)
    if tool_calling == "json":  # the format and the tools, in the shared cached prefix
        shown = shows_schema(opts.system_prompt, contract.json_schema)
        system = "\n\n".join(p for p in (opts.system_prompt or "", json_instructions(
            [t.openai_schema() for t in tools], contract.json_schema, schema_shown=shown))
            if p)
    assert isinstance(opts.model, str)  # check_options refused anything else
    plan = BatchPlan(
        batch_id=opts.batch_id or uuid.uuid4().hex[:16],
        total=len(items),
        model=opts.model,
        backends=backends,
        system_message=system,
        tool_refs=[ToolRef(name=t.name, import_path=t.import_path) for t in tools],
        tool_schemas=[t.openai_schema() for t in tools],
        output_schema_path=schema_import_path(opts.output_schema),
        output_schema_name=contract.name,
        output_json_schema=contract.json_schema,
        **{**BatchPlan.option_values(opts), "tool_calling": tool_calling,
           "prices": load_prices(opts.prices, opts.model)},
        created_at=time.time(),
    )
    states = [
        AgentState(index=i, input=item, messages=[{"role": "user", "content": prompt}])
        for i, (item, prompt) in enumerate(zip(items, prompts, strict=True))
    ]
    return CompiledBatch(plan=plan, states=states, tools=tools, contract=contract)
