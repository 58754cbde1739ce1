"""``fit_request``'s quick bound (issue 26 item 5) never under-estimates the byte bound it
stands in for, so a turn it lets through is one ``measure`` lets through, with the same
outcome; near the limit the exact count decides, as before."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from agentbatch.core import compaction as cp
from agentbatch.core.agent_state import AgentState
from agentbatch.core.model_io import Message, ModelRequest
from agentbatch.core.options import BatchOptions
from agentbatch.turnloop import context_fit
from agentbatch.turnloop.compile import compile_batch
from agentbatch.turnloop.context_fit import Fitted, _quick_json_bytes, fit_request
from agentbatch.turnloop.runtime import BatchRuntime
from tests.support.fake_backend import ScriptedBackend
from tests.support.tools import lookup

# --- the bound itself -----------------------------------------------------------------------

_ALPHABET = "ab \"\\\n\t\r\x00\x01\x1f\x7f{}[]:,'/"


def _text(rng: random.Random) -> str:
    return "".join(rng.choice(_ALPHABET) for _ in range(rng.randrange(0, 40)))


def _value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(8 if depth < 5 else 5)
    if kind == 0:
        return _text(rng)
    if kind == 1:
        return None
    if kind == 2:
        return rng.choice([True, False])
    if kind == 3:
        return rng.randrange(-10**12, 10**12)
    if kind == 4:
        return _text(rng)
    if kind in (5, 6):
        return {_text(rng): _value(rng, depth + 1) for _ in range(rng.randrange(0, 4))}
    return [_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))]


def test_the_quick_bound_is_never_under_the_json_bytes() -> None:
    rng = random.Random(2605)
    told = 0
    for _ in range(3000):
        value = _value(rng)
        quick = _quick_json_bytes(value)
        if quick is not None:
            told += 1
            assert quick >= cp._json_bytes(value), value
    assert told > 2500  # deep values aside, every one of these is bounded


@pytest.mark.parametrize("text", ["\x01" * 50, "\x1f", "", '"' * 9, "\\" * 9, "\n\t\b\f\r"])
def test_the_worst_characters_are_bounded(text: str) -> None:
    for value in (text, {text: text}, [text, {"content": text, "k": None}], {"": [text]}):
        quick = _quick_json_bytes(value)
        assert quick is not None and quick >= cp._json_bytes(value)
    assert _quick_json_bytes("\x01" * 50) == cp._json_bytes("\x01" * 50)  # 6 a char: tight


@pytest.mark.parametrize("value", [
    1.5, float("nan"), "é", {"é": "x"}, {1: "x"}, {"k": 2.0}, ["x", "ü"], {"k": ("t",)},
    {"k": {"k": {"k": {"k": {"k": {"k": {"k": {"k": {"k": {}}}}}}}}}},
])
def test_what_json_may_render_otherwise_is_left_to_the_exact_count(value: Any) -> None:
    assert _quick_json_bytes(value) is None


def test_a_lone_surrogate_still_fails_as_the_exact_count_does() -> None:
    # non-ASCII text goes the exact way, which cannot encode a lone surrogate
    assert _quick_json_bytes(["\ud800"]) is None
    with pytest.raises(UnicodeEncodeError):
        cp._json_bytes(["\ud800"])


# --- fit_request: the same outcome with and without the shortcut ---------------------------


class CountingBackend(ScriptedBackend):
    def __init__(self, name: str) -> None:
        super().__init__(name=name)
        self.counted = 0

    async def count_tokens(self, prompt: str | list[Message],
                           tools: list[dict[str, Any]] | None = None) -> int | None:
        self.counted += 1
        return len(str(prompt)) // 4


def _runtime(context: int, backend: ScriptedBackend, compaction: str | None) -> BatchRuntime:
    compiled = compile_batch(BatchOptions(
        task="t {x}", inputs=[{"x": 1}], model="m", backend="sim://127.0.0.1:8000",
        tools=[lookup], max_context_tokens=context, compaction=compaction))  # type: ignore[arg-type]
    return BatchRuntime(plan=compiled.plan, contract=compiled.contract, tools=None,  # type: ignore[arg-type]
                        backend=backend)


def _conversation(n: int, body: str) -> list[Message]:
    msgs: list[Message] = [{"role": "system", "content": "Answer in the schema."},
                           {"role": "user", "content": "look k up"}]
    for r in range(n):
        msgs.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": f"c{r}", "type": "function",
             "function": {"name": "lookup", "arguments": '{"key":"k"}'}}]})
        msgs.append({"role": "tool", "tool_call_id": f"c{r}", "content": body})
    return msgs


async def _fit(context: int, messages: list[Message], *, quick: bool,
               compaction: str | None, monkeypatch: pytest.MonkeyPatch,
               ) -> tuple[Fitted | Any, int, list[int | None]]:
    backend = CountingBackend(f"quick-{quick}-{context}-{len(messages)}-{compaction}")
    rt = _runtime(context, backend, compaction)
    seen: list[int | None] = []
    real = context_fit._quick_json_bytes

    def spy(value: Any, depth: int = 0) -> int | None:
        got = real(value, depth) if quick else None
        if depth == 0:
            seen.append(got)
        return got

    monkeypatch.setattr(context_fit, "_quick_json_bytes", spy)
    request = ModelRequest(model="m", messages=messages, tools=rt.plan.tool_schemas,
                           max_tokens=64)
    state = AgentState(index=0, input={"x": 1}, messages=messages)
    out = await fit_request(rt, state, request)
    return out, backend.counted, seen


_BODY = '{"key":"k","value":"' + "v\n\x01" * 60 + '"}'  # escapes: 2 and 6 bytes a char


@pytest.mark.parametrize("slack", [-400, -1, 0, 1, 400, 5_000, 50_000])
@pytest.mark.parametrize("compaction", [None, "truncate"])
async def test_fit_request_gives_what_measure_gave(slack: int, compaction: str | None,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    messages = _conversation(6, _BODY)
    rt = _runtime(10_000, CountingBackend("sizes"), None)
    exact = cp.token_upper_bound(messages, rt.plan.tool_schemas)  # ``measure``'s bound
    # the prompt's bound ``slack`` tokens under the target (compaction's target when on)
    target = exact + slack
    context = target + 64 if compaction is None else math.ceil(target / 0.8)
    fast, fast_counts, seen = await _fit(context, messages, quick=True,
                                         compaction=compaction, monkeypatch=monkeypatch)
    slow, slow_counts, _ = await _fit(context, messages, quick=False,
                                      compaction=compaction, monkeypatch=monkeypatch)
    assert type(fast) is type(slow)
    if isinstance(fast, Fitted):
        assert isinstance(slow, Fitted)
        assert fast.count == slow.count and fast.usage == slow.usage
        assert fast.request.messages == slow.request.messages
    else:
        assert fast == slow  # the same Abandoned, sizes in its message included
    assert fast_counts == slow_counts  # the server was asked exactly as often
    assert seen and seen[0] is not None  # the quick bound was tried on this conversation


async def test_well_under_the_limit_the_request_passes_untouched_and_estimated(
        monkeypatch: pytest.MonkeyPatch) -> None:
    messages = _conversation(2, '{"key":"k"}')
    calls: list[int] = []
    real = cp.token_upper_bound

    def spy(messages: list[Message], tools: list[dict[str, Any]] | None = None) -> int:
        if messages:  # (the tools are sized alone, once, on their own)
            calls.append(len(messages))
        return real(messages, tools)

    monkeypatch.setattr(cp, "token_upper_bound", spy)
    out, counted, _ = await _fit(100_000, messages, quick=True, compaction=None,
                                 monkeypatch=monkeypatch)
    assert isinstance(out, Fitted) and out.count == "estimated" and out.usage is None
    assert counted == 0 and calls == []  # no full dump, no server count
