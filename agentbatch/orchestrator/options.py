"""What a caller can set on a batch (layered: defaults < environment < call)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from ..toolpool.output_cap import DEFAULT_MAX_TOOL_OUTPUT_CHARS

DEFAULT_MAX_INFLIGHT = 256
# Tool calls run from one model reply; the rest are answered with an error, so one runaway
# reply cannot flood the tool queue.
DEFAULT_MAX_TOOL_CALLS_PER_TURN = 32


@dataclass
class BatchOptions:
    """The arguments of ``submit_batch``; see its docstring for each field."""

    task: str
    inputs: Sequence[Any]
    model: str = "sim-model"
    backend: str | Sequence[str] = "sim://127.0.0.1:8000"
    system_prompt: str | None = None
    tools: Sequence[Any] = ()
    output_schema: type[BaseModel] | None = None
    max_turns: int = 6
    max_retries: int = 2
    max_inflight: int | None = None
    timeout_per_turn: float | None = 120.0
    timeout_per_tool: float | None = 60.0
    max_tokens: int | None = None
    temperature: float | None = None
    on_result: Callable[[Any], Any] | None = None
    native_json_schema: bool = True
    warm_prefix: bool = True
    batch_prompting: bool = False
    max_server_waiting: int | None = None
    max_tool_calls_per_turn: int = DEFAULT_MAX_TOOL_CALLS_PER_TURN
    max_tool_output_chars: int = DEFAULT_MAX_TOOL_OUTPUT_CHARS
    tool_calling: str = "native"
    tool_choice: str = "auto"
    redis_url: str | None = None
    batch_id: str | None = None
    checkpoint_dir: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
