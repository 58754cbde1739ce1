"""One agent's durable state: everything needed to resume it on any node."""

from __future__ import annotations

from enum import Enum
from typing import Any

from pydantic import BaseModel, Field

from agentbatch.core.model_io import Message, ToolCall, Usage
from agentbatch.core.results import AgentError, ToolCallRecord


class AgentStatus(str, Enum):
    """Where an agent is in its loop. The next action is a function of this alone."""

    NEEDS_MODEL = "needs_model"
    AWAITING_TOOLS = "awaiting_tools"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (AgentStatus.DONE, AgentStatus.FAILED, AgentStatus.CANCELLED)


class AgentState(BaseModel):
    """Versioned agent state. ``version`` grows by one on every transition (the fencing token)."""

    index: int
    input: dict[str, Any]
    status: AgentStatus = AgentStatus.NEEDS_MODEL
    version: int = 0
    steps: int = 0  # model turns counted against max_turns
    turns: int = 0  # every successful model reply, repair turns included
    retries: int = 0  # retries spent (failed calls and repair turns), bounded by max_retries
    repairing: bool = False  # the next model turn is a repair turn
    messages: list[Message] = Field(default_factory=list)  # the conversation after the prefix
    pending_calls: list[ToolCall] = Field(default_factory=list)
    usage: Usage = Field(default_factory=Usage)
    # The part of ``usage`` served through a provider's batch API (priced at ``batch_`` rates)
    # and how many replies that was; the rest went through the sync API.
    batch_usage: Usage = Field(default_factory=Usage)
    batch_turns: int = 0
    # Tokens of hedged turns' losing requests: paid for (at the sync prices) but not in
    # ``usage``, which counts the replies the agent used. None until a hedge has lost.
    hedge_usage: Usage | None = None
    # The pool endpoint that served the last reply: where the conversation is cached, so the
    # next turn goes there on any process (``ModelRequest.cached_on``). None off a pool.
    endpoint: str | None = None
    tool_log: list[ToolCallRecord] = Field(default_factory=list)
    text: str | None = None
    ttft_s: float | None = None  # time to first token of the first streamed model turn
    output: Any = None  # the validated JSON value when DONE
    error: AgentError | None = None

    @property
    def terminal(self) -> bool:
        return self.status.terminal
