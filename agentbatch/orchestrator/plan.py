"""The compiled, JSON-serializable description of a batch.

A plan is everything a worker on another machine needs to run any agent of the batch: the
shared prefix, tool and schema import paths, limits. It is written once per batch.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from .options import DEFAULT_MAX_TOOL_CALLS_PER_TURN, DEFAULT_MAX_TOOL_OUTPUT_CHARS


class ToolRef(BaseModel):
    """A tool by name plus where a worker can import it from (None: in-process only)."""

    name: str
    import_path: str | None = None


class BatchPlan(BaseModel):
    """Per-batch constants. ``system_message`` + ``tool_schemas`` form the shared prefix."""

    batch_id: str
    total: int
    model: str
    backends: list[str]
    system_message: str
    tool_refs: list[ToolRef] = Field(default_factory=list)
    tool_schemas: list[dict[str, Any]] = Field(default_factory=list)
    output_schema_path: str | None = None
    output_schema_name: str | None = None
    output_json_schema: dict[str, Any] | None = None
    max_turns: int = 6
    max_retries: int = 2
    max_inflight: int | None = None
    timeout_per_turn: float | None = 120.0
    timeout_per_tool: float | None = 60.0
    max_tokens: int | None = None
    temperature: float | None = None
    native_json_schema: bool = True
    warm_prefix: bool = True
    batch_prompting: bool = False
    max_server_waiting: int | None = None
    max_tool_calls_per_turn: int = DEFAULT_MAX_TOOL_CALLS_PER_TURN
    # a tool's output is cut to this many chars, with a marker (``toolpool/output_cap.py``)
    max_tool_output_chars: int = DEFAULT_MAX_TOOL_OUTPUT_CHARS
    # "native" or "json" (resolved from "auto" at submit): see ``json_tool_calling``.
    tool_calling: str = "native"
    # "auto" or "required" (a tool call before the final answer): see ``tool_choice``.
    tool_choice: str = "auto"
    created_at: float = 0.0

    @property
    def has_tools(self) -> bool:
        return bool(self.tool_schemas)
