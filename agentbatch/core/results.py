"""What a batch hands back: one ``AgentResult`` per input."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from agentbatch.core.model_io import Usage

# Every kind an agent's error can have, and where it comes from.
ErrorKind = Literal[
    "invalid_output",  # the final answer failed the output schema after the repair turns
    "max_turns",  # max_turns used up without a final answer
    "cancelled",  # the batch was cancelled before the agent finished
    # a model call failed past its retries (``errors.BackendError`` subclasses):
    "backend", "timeout", "rate_limited", "server_error", "backend_unavailable",
    "bad_request", "server_busy",
    # a worker could not set the batch up (``distributed/workers/context.py``):
    "tool_import",  # a tool's import path did not import there
    "schema_import",  # the output schema's import path did not import there
    "config",  # the backend could not be built there (e.g. a missing API key)
    "internal",  # a bug or damaged state: the step raised, or the state entry is unreadable
    # the next turn's prompt does not fit the context, even after compaction (never sent):
    "context_overflow",
    # max_cost_usd or max_agent_cost_usd reached: no new turn was started (``budget.py``):
    "budget_exceeded",
]


class AgentError(BaseModel):
    """Why an agent ended without a valid output; ``kind`` is one of ``ErrorKind``."""

    kind: ErrorKind
    message: str


class ToolCallRecord(BaseModel):
    """One tool call an agent made, for auditing."""

    turn: int
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    ok: bool = True
    cached: bool = False
    coalesced: bool = False
    # The worker whose outcome this is lost the call's lock while the tool ran: another
    # worker took the call over and ran it too (at-least-once; see ``ToolContext``).
    lock_lost: bool = False
    # Why the call failed (``ok=False``): the error text the model was shown, e.g. a path
    # outside the tool's root. None when it succeeded.
    error: str | None = None


class AgentResult(BaseModel):
    """The outcome of one agent. A failure is data (``ok=False`` + ``error``), not an exception."""

    model_config = {"arbitrary_types_allowed": True}

    index: int
    input: dict[str, Any]
    ok: bool
    output: Any = None  # an instance of the batch's output_schema when ok and a schema was given
    text: str | None = None  # the final assistant text (the raw JSON when a schema was given)
    error: AgentError | None = None
    turns: int = 0
    usage: Usage = Field(default_factory=Usage)
    tool_calls: list[ToolCallRecord] = Field(default_factory=list)
    # ``usage`` at the batch's ``prices`` (US dollars); None when the batch has no prices.
    cost_usd: float | None = None
    latency_s: float | None = None
    # Seconds from sending the agent's first streamed model turn to its first token; None
    # when no turn streamed (streaming is a backend option: ``?stream=1``, llamacpp:// default).
    ttft_s: float | None = None
    # The agent's whole conversation after the shared system prompt (OpenAI chat format:
    # user, assistant with ``tool_calls``, ``tool`` outputs), when kept: ``keep_transcript``,
    # or the agent failed. None when not kept (docs/transcripts.md).
    messages: list[dict[str, Any]] | None = None

    def to_json_dict(self) -> dict[str, Any]:
        """JSON-ready form; ``output`` is dumped through its Pydantic model."""
        data = self.model_dump(exclude={"output"})
        out = self.output
        data["output"] = out.model_dump(mode="json") if isinstance(out, BaseModel) else out
        return data
