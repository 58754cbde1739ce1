"""The wire-neutral shapes exchanged between the agent core and the backends.

Messages are kept in the OpenAI chat format (the format every self-hosted server speaks), with
tool-call arguments as canonical JSON strings. Backends for other APIs (Anthropic, Bedrock)
convert at their edge. Everything here is JSON-serializable so agent state can live in Redis.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, Field, model_validator

Message = dict[str, Any]
_M = TypeVar("_M", bound=BaseModel)
# ``json.dumps`` with these arguments, made once: ``dumps`` builds a new encoder on each call
# that passes any (issue 26 item 5).
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def agent_key(batch_id: str, index: int) -> str:
    """One agent's routing key, ``batch_id:index``: its affinity and prefix locality in an
    endpoint pool, and its first turn's place (``backends/affinity.spread`` parses it)."""
    return f"{batch_id}:{index}"


def canonical_json(value: Any) -> str:
    """Stable, compact JSON: the same value always gives the same bytes (cache/coalescing keys)."""
    return _CANONICAL.encode(value)


_set_attr = object.__setattr__


def replaced(model: _M, update: dict[str, Any]) -> _M:
    """``model.model_copy(update=update)``: a new instance, its field dict copied and updated,
    the updated fields marked set, no validation. For a model with no private attributes and
    no extra fields (the agent state, a model reply) it is made here in one step; pydantic's
    goes through ``__copy__`` and ``copy.copy`` three times, and the turn machine and the
    turn loop copy on every turn (issue 26 item 5). Any other model: ``model_copy``."""
    cls = type(model)
    if cls.__private_attributes__ or cls.model_config.get("extra") == "allow":
        return model.model_copy(update=update)
    new = cls.__new__(cls)
    _set_attr(new, "__dict__", {**model.__dict__, **update})
    _set_attr(new, "__pydantic_extra__", None)
    _set_attr(new, "__pydantic_fields_set__", model.__pydantic_fields_set__ | update.keys())
    _set_attr(new, "__pydantic_private__", None)
    return new


class ToolCall(BaseModel):
    """One tool invocation requested by the model."""

    id: str
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    # Set when the model sent arguments that are not a JSON object; the core answers the
    # call with an error instead of running the tool.
    arguments_error: str | None = None

    def to_message_part(self) -> dict[str, Any]:
        """This call as an entry of an OpenAI assistant message's ``tool_calls``."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": canonical_json(self.arguments)},
        }


def _generated_id(index: int, call: ToolCall) -> str:
    """A stable id for a call the server left unnamed: replays give identical messages."""
    seed = f"{index}|{call.name}|{canonical_json(call.arguments)}".encode()
    return "call_" + hashlib.sha256(seed).hexdigest()[:24]


def unique_call_ids(calls: list[ToolCall]) -> list[ToolCall]:
    """``calls`` with every id non-empty and unique within the reply.

    Tool results are matched to calls by id, so two calls sharing one would both get one
    result (or, distributed, one would never run and the fan-in would never complete). A
    repeat becomes ``id-2``, ``id-3``... and an empty id a generated one. The id of call ``i``
    depends only on calls ``0..i``, so a streamed call announced early keeps its id.
    """
    seen: set[str] = set()
    out: list[ToolCall] = []
    for index, call in enumerate(calls):
        base = call.id or _generated_id(index, call)
        new_id, n = base, 1
        while new_id in seen:
            n += 1
            new_id = f"{base}-{n}"
        seen.add(new_id)
        out.append(call if new_id == call.id else call.model_copy(update={"id": new_id}))
    return out


class Usage(BaseModel):
    """Token counts; ``cached_tokens`` is the part of the prompt served from a prefix cache."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    # How the prompt was sized against the context before it was sent: "counted" by the
    # server's own /tokenize, or "estimated" from its characters; None when no context
    # length was known, so nothing was checked (``turnloop/context_fit.py``).
    prompt_count: Literal["counted", "estimated"] | None = None

    def __add__(self, other: Usage) -> Usage:
        # Validated, not ``model_construct``: pydantic's construct is a Python loop, 2-4x
        # slower than the compiled validator on a model this small (runs twice per turn).
        return Usage(
            prompt_tokens=self.prompt_tokens + other.prompt_tokens,
            cached_tokens=self.cached_tokens + other.cached_tokens,
            completion_tokens=self.completion_tokens + other.completion_tokens,
            prompt_count=other.prompt_count or self.prompt_count,
        )


class ModelRequest(BaseModel):
    """One model turn, fully rendered. Identical prefixes across agents are byte-identical."""

    model: str
    messages: list[Message]
    tools: list[dict[str, Any]] = Field(default_factory=list)  # OpenAI function-tool schemas
    # {"name": ..., "schema": {...}} when the output must fit a JSON schema.
    json_schema: dict[str, Any] | None = None
    tool_choice: str | None = None  # "auto" | "none" | None (server default)
    max_tokens: int | None = None
    temperature: float | None = None
    request_id: str = ""  # stable per (batch, agent, turn, attempt)
    agent_key: str = ""  # stable per agent: routing affinity / prefix locality
    # The pool endpoint that served the agent's last reply, where its conversation is cached
    # (``AgentState.endpoint``): an endpoint pool sends the turn there (``backends/pool.py``).
    cached_on: str | None = None
    turns_left: int = 1  # scheduling hint (e.g. Dynamo agent_hints)
    # The deadline of the whole turn, every transport retry included.
    timeout_s: float | None = None
    # HTTP attempts this turn may make (1 = no retry); None leaves it to the retry policy.
    max_attempts: int | None = Field(default=None, ge=1)


# ``ModelResponse.finish_reason`` of a streamed reply the client stopped because it looped
# (``backends/loop_guard.py``); the turn machine answers it as it does a cut-off ("length").
FINISH_LOOP = "loop"


class ModelResponse(BaseModel):
    """What a backend returns for one model turn."""

    text: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    usage: Usage = Field(default_factory=Usage)
    finish_reason: str | None = None
    ttft_s: float | None = None
    # HTTP attempts this reply took (set by ``RetryingBackend``); charged to ``max_retries``.
    attempts: int = 1
    # A hedged turn's losing request (``backends/hedge.py``): tokens paid for but not part of
    # this reply, priced into the agent's ``cost_usd`` and the batch's spend at sync prices.
    hedge_usage: Usage | None = None
    # The pool endpoint that answered (set by ``EndpointPool``): the agent's next turn goes
    # there, where its conversation is now cached. None off a pool.
    endpoint: str | None = None

    @model_validator(mode="after")
    def _unique_call_ids(self) -> ModelResponse:
        """Every backend's reply passes here, so no backend can hand out duplicate ids."""
        self.tool_calls = unique_call_ids(self.tool_calls)
        return self

    def to_message(self) -> Message:
        """The assistant message to append to the conversation."""
        msg: Message = {"role": "assistant", "content": self.text or ""}
        if self.tool_calls:
            msg["tool_calls"] = [c.to_message_part() for c in self.tool_calls]
            if not self.text:
                msg["content"] = None
        return msg


class ToolOutcome(BaseModel):
    """The result of one tool call, as fed back to the model.

    A failing tool is not a failing agent: ``ok=False`` carries error text the model can read.
    """

    call_id: str
    name: str
    content: str
    ok: bool = True
    cached: bool = False  # served from the result cache (no execution)
    coalesced: bool = False  # shared the execution of an identical concurrent call
    lock_lost: bool = False  # the call's lock was lost while it ran: it ran twice, or may have

    def to_message(self) -> Message:
        return {"role": "tool", "tool_call_id": self.call_id, "content": self.content}
