"""Pure assembly of a streamed (SSE) OpenAI chat completion into one ``ModelResponse``.

Streaming buys two things for agents: time-to-first-token is measurable, and a tool call can
start running the moment its arguments are complete instead of when the whole reply is. A tool
call's pieces arrive keyed by ``index`` (id and name in the first piece, arguments spread over
the rest); call ``i`` is complete once a piece for a *later* index arrives, or the stream ends.
No I/O here, so recorded chunk sequences can be replayed in unit tests.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

from agentbatch.backends.limits import ResponseTooLarge
from agentbatch.backends.openai_parse import parse_tool_calls, parse_usage
from agentbatch.core.errors import ServerError
from agentbatch.core.model_io import ModelResponse, ToolCall

log = logging.getLogger(__name__)

ToolCallListener = Callable[[ToolCall], None]

# Per-task listener for early tool calls: an engine sets it around ``backend.complete`` and it
# survives the retry/pool wrappers because they all run in the caller's task.
ON_TOOL_CALL: ContextVar[ToolCallListener | None] = ContextVar(
    "agentbatch_on_tool_call", default=None
)


@contextlib.contextmanager
def tool_call_listener(listener: ToolCallListener | None) -> Iterator[None]:
    """``with tool_call_listener(cb): await backend.complete(req)`` -- early tool calls of
    streaming backends in this task go to ``cb``."""
    token = ON_TOOL_CALL.set(listener)
    try:
        yield
    finally:
        ON_TOOL_CALL.reset(token)


class SSEDecoder:
    """Server-sent-events framing: ``data:`` lines joined until a blank line ends the event.

    Lenient for servers that omit the blank line between events: a new ``data:`` line after a
    buffered payload that is already complete JSON (or ``[DONE]``) starts a new event.
    """

    def __init__(self) -> None:
        self._data: list[str] = []

    def _complete(self) -> bool:
        text = "\n".join(self._data)
        if text.strip() == "[DONE]":
            return True
        try:
            json.loads(text)
        except ValueError:
            return False
        except RecursionError:
            return True  # complete enough: ``feed_data`` rejects it as a server error
        return True

    def feed(self, line: str) -> list[str]:
        """Feed one line (without its newline); returns the data of any events it completed."""
        line = line.rstrip("\r")
        if not line:
            return self.flush()
        if line.startswith(":"):  # comment / keep-alive
            return []
        field, _, value = line.partition(":")
        if field != "data":
            return []  # event:, id:, retry: carry nothing we need
        value = value[1:] if value.startswith(" ") else value
        out = self.flush() if self._data and self._complete() else []
        self._data.append(value)
        return out

    def flush(self) -> list[str]:
        """The buffered event, if any (call at end of stream)."""
        if not self._data:
            return []
        data, self._data = "\n".join(self._data), []
        return [data]


class StreamAssembler:
    """Accumulates chat-completion chunks; ``finish()`` gives the ``ModelResponse``.

    ``on_tool_call`` is called (synchronously, at most once per call) as each tool call
    completes; it must not raise, and an error it raises is logged and ignored so a listener
    bug never fails the turn. Calls reported from an attempt that later fails may be
    re-reported by a retry with different ids: listeners must treat them as speculative.
    """

    def __init__(
        self,
        *,
        request_id: str = "",
        on_tool_call: ToolCallListener | None = None,
        who: str = "backend",
    ) -> None:
        self.request_id = request_id
        self.on_tool_call = on_tool_call
        self.who = who
        self.text_parts: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}  # index -> raw OpenAI tool call
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.saw_delta = False  # first content or tool-call delta seen (for TTFT)
        self.done = False
        self._reported: set[int] = set()

    def feed_data(self, data: str) -> bool:
        """One SSE event's data; returns True when the first content/tool delta just arrived."""
        if data.strip() == "[DONE]":
            self.done = True
            return False
        try:
            chunk = json.loads(data)
        except ValueError:
            raise ServerError(
                f"{self.who}: stream chunk is not JSON: {data[:200]!r}", status=200
            ) from None
        except RecursionError:
            raise ResponseTooLarge(
                f"{self.who}: stream chunk nests JSON too deeply to decode", status=200
            ) from None
        return self.feed_chunk(chunk)

    def feed_chunk(self, chunk: Any) -> bool:
        if not isinstance(chunk, dict):
            raise ServerError(f"{self.who}: stream chunk is not a JSON object", status=200)
        if chunk.get("error") or chunk.get("object") == "error":
            err = chunk.get("error", chunk)
            msg = err.get("message") if isinstance(err, dict) else err
            raise ServerError(f"{self.who}: error in stream: {str(msg)[:300]}", status=200)
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        first = False
        choices = chunk.get("choices")
        for choice in choices if isinstance(choices, list) else []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):
                first = self._delta(delta) or first
            reason = choice.get("finish_reason")
            if isinstance(reason, str):
                self.finish_reason = reason
        return first

    def _delta(self, delta: dict[str, Any]) -> bool:
        was = self.saw_delta
        content = delta.get("content")
        if isinstance(content, str) and content:
            self.text_parts.append(content)
            self.saw_delta = True
        pieces = delta.get("tool_calls")
        for piece in pieces if isinstance(pieces, list) else []:
            if isinstance(piece, dict):
                self._tool_piece(piece)
                self.saw_delta = True
        return self.saw_delta and not was

    def _tool_piece(self, piece: dict[str, Any]) -> None:
        index = piece.get("index")
        if not isinstance(index, int):
            # No index: a new id starts a new call, anything else continues the last one.
            last = max(self.calls) if self.calls else -1
            new_id = piece.get("id")
            starts = last < 0 or (new_id and new_id != self.calls[last].get("id"))
            index = last + 1 if starts else last
        if index not in self.calls:
            # A later index starting means every earlier call is complete.
            for earlier in sorted(self.calls):
                if earlier < index:
                    self._report(earlier)
            self.calls[index] = {"type": "function", "function": {"name": "", "arguments": ""}}
        call = self.calls[index]
        if isinstance(piece.get("id"), str) and piece["id"]:
            call["id"] = piece["id"]
        fn = piece.get("function")
        if isinstance(fn, dict):
            name = fn.get("name")
            # Usually the whole name comes once; tolerate repeats and (rare) fragments.
            if isinstance(name, str) and name and name != call["function"]["name"]:
                call["function"]["name"] += name
            args = fn.get("arguments")
            if isinstance(args, str):
                call["function"]["arguments"] += args
            elif isinstance(args, dict):  # some servers send the parsed object at once
                call["function"]["arguments"] = json.dumps(args)

    def _tool_calls(self) -> list[ToolCall]:
        return parse_tool_calls([self.calls[i] for i in sorted(self.calls)], self.request_id)

    def _report(self, index: int) -> None:
        if self.on_tool_call is None or index in self._reported:
            return
        self._reported.add(index)
        position = sorted(self.calls).index(index)
        call = self._tool_calls()[position]
        try:
            self.on_tool_call(call)
        except Exception:
            log.exception("%s: on_tool_call listener failed for %s", self.who, call.name)

    def finish(self) -> ModelResponse:
        """The assembled response; reports any tool call not reported yet."""
        for index in sorted(self.calls):
            self._report(index)
        text = "".join(self.text_parts)
        return ModelResponse(
            text=text or None,
            tool_calls=self._tool_calls(),
            usage=parse_usage({"usage": self.usage or {}}),
            finish_reason=self.finish_reason,
        )
