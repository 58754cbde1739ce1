"""A batch made runnable: plan + policy + tools + output contract + backend.

The embedded engine builds one from live objects; a worker builds one from a stored plan by
importing tools and the schema by path, only under its import allowlist (see
``import_allowlist``: the plan comes from Redis, and importing a module runs its code).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from agentbatch.backends.base import Backend
from agentbatch.core.errors import BatchSpecError
from agentbatch.core.import_allowlist import check_import_path, owns_path
from agentbatch.core.output import OutputContract
from agentbatch.core.plan import BatchPlan
from agentbatch.core.turns import TurnPolicy
from agentbatch.toolpool import Tool, ToolPool, resolve_tool
from agentbatch.turnloop.json_tool_calling import final_parser


def import_object(path: str) -> Any:
    """``module:attr.sub`` → the object."""
    module_name, _, attr = path.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def load_schema(plan: BatchPlan, *, allowed_imports: tuple[str, ...]) -> type[BaseModel] | None:
    """The plan's output schema, imported only if its module is under ``allowed_imports``."""
    if plan.output_json_schema is None:
        return None
    if not plan.output_schema_path:
        raise BatchSpecError(f"output schema {plan.output_schema_name} has no import path")
    check_import_path(plan.output_schema_path, allowed_imports, "output schema", nested=True)
    try:
        schema = import_object(plan.output_schema_path)
    except Exception as exc:
        raise BatchSpecError(
            f"output schema {plan.output_schema_path!r} could not be imported: {exc}"
        ) from None
    if not (isinstance(schema, type) and issubclass(schema, BaseModel)):
        raise BatchSpecError(f"{plan.output_schema_path!r} is not a Pydantic model")
    if not owns_path(schema, plan.output_schema_path):
        raise BatchSpecError(f"output schema {plan.output_schema_path!r} is a re-export of "
                             f"{schema.__module__}:{schema.__qualname__}, not defined there")
    return schema


def load_tools(plan: BatchPlan, *, allowed_imports: tuple[str, ...]) -> list[Tool]:
    """The plan's tools; every path is checked against ``allowed_imports`` before any import."""
    paths: list[tuple[str, str]] = []
    for ref in plan.tool_refs:
        if not ref.import_path:
            raise BatchSpecError(f"tool {ref.name!r} has no import path")
        check_import_path(ref.import_path, allowed_imports, f"tool {ref.name!r}:")
        paths.append((ref.name, ref.import_path))
    tools = []
    for name, path in paths:
        try:
            tool = resolve_tool(path)
        except BatchSpecError as exc:
            raise BatchSpecError(f"tool {name!r}: {exc}") from None
        if not owns_path(tool, path):
            raise BatchSpecError(f"tool {name!r}: {path!r} is a re-export of the tool at "
                                 f"{tool.import_path!r}, not defined there")
        tools.append(tool)
    return tools


@dataclass
class BatchRuntime:
    plan: BatchPlan
    contract: OutputContract
    tools: ToolPool
    backend: Backend
    policy: TurnPolicy = field(init=False)

    def __post_init__(self) -> None:
        self.policy = TurnPolicy(
            max_turns=self.plan.max_turns,
            max_retries=self.plan.max_retries,
            parse_output=(final_parser(self.contract) if self.plan.tool_calling == "json"
                          else self.contract.parse),
            max_tool_calls_per_turn=self.plan.max_tool_calls_per_turn,
            require_tool_call=self.plan.tool_choice == "required",
            required_tool_rounds=self.plan.required_tool_rounds,
        )
