"""The per-turn shortcuts of issue 26 item 5 do what the code they replace did.

``replaced`` is ``model_copy(update=...)``, ``construct`` keeps building each field as
``_construct_value`` does, ``check_input``'s flat-value path refuses what the walk refused,
``OutputContract.json_schema`` is still a fresh copy, and the module-level JSON encoders give
``json.dumps``'s bytes and errors.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from agentbatch.backends.http_session import encode_json
from agentbatch.backends.openai_parse import _as_int
from agentbatch.core.agent_state import AgentState, AgentStatus
from agentbatch.core.compaction import MESSAGE_OVERHEAD_TOKENS, token_upper_bound
from agentbatch.core.errors import BadRequest, BatchSpecError
from agentbatch.core.model_io import (
    ModelResponse,
    ToolCall,
    Usage,
    canonical_json,
    replaced,
)
from agentbatch.core.output import OutputContract, _construct_value, _kept, construct
from agentbatch.core.results import AgentResult
from agentbatch.turnloop.validate import check_input

# --- replaced == model_copy(update=...) ---------------------------------------------------


def _same_copy(a: BaseModel, b: BaseModel) -> None:
    assert type(a) is type(b)
    assert a.__dict__ == b.__dict__
    assert a.model_fields_set == b.model_fields_set
    assert a.__pydantic_extra__ == b.__pydantic_extra__
    assert a.__pydantic_private__ == b.__pydantic_private__


def test_replaced_is_model_copy_for_the_agent_state_and_a_reply() -> None:
    state = AgentState(index=3, input={"k": "v"}, messages=[{"role": "user", "content": "x"}])
    update = {"version": 1, "status": AgentStatus.AWAITING_TOOLS, "steps": 1}
    new = replaced(state, update)
    _same_copy(new, state.model_copy(update=update))
    assert new is not state and new.__dict__ is not state.__dict__
    assert state.version == 0 and state.status is AgentStatus.NEEDS_MODEL  # untouched
    assert new.model_fields_set - state.model_fields_set == set(update)

    result = AgentResult(index=1, input={}, ok=True, output={"x": 1})
    _same_copy(replaced(result, {"output": Inner(x=1)}),
               result.model_copy(update={"output": Inner(x=1)}))

    reply = ModelResponse(text="hi", tool_calls=[ToolCall(id="c", name="t")])
    usage = Usage(prompt_tokens=5, prompt_count="estimated")
    _same_copy(replaced(reply, {"usage": usage}), reply.model_copy(update={"usage": usage}))


class _Private(BaseModel):
    a: int = 0
    _secret: str = PrivateAttr(default="s")


class _Extra(BaseModel):
    model_config = ConfigDict(extra="allow")
    a: int = 0


def test_replaced_hands_models_with_private_or_extra_fields_to_model_copy() -> None:
    p = _Private(a=1)
    _same_copy(replaced(p, {"a": 2}), p.model_copy(update={"a": 2}))
    assert replaced(p, {"a": 2})._secret == "s"
    e = _Extra(a=1, b=2)
    got = replaced(e, {"a": 3, "c": 4})
    _same_copy(got, e.model_copy(update={"a": 3, "c": 4}))
    assert got.__pydantic_extra__ == {"b": 2, "c": 4}


# --- construct: fields worked out once per model --------------------------------------------


class Inner(BaseModel):
    x: int
    tags: list[str] = Field(default_factory=list)


class Other(BaseModel):
    y: str


class Outer(BaseModel):
    name: str = Field(alias="Name")
    kind: Literal["a", "b"]
    score: float
    inner: Inner
    maybe: Inner | None = None
    either: Inner | Other | None = None
    many: list[Inner]
    pair: tuple[str, ...]
    by_key: dict[str, Inner]
    plain: dict[str, Any]
    words: list[str]
    blob: Any = None


ANNOTATIONS: list[Any] = [
    str, float, int, Any, Literal["a", "b"], Inner, Inner | None, Inner | Other | None,
    list[Inner], list[str], tuple[str, ...], set[int], frozenset[int], dict[str, Inner],
    dict[str, Any], dict, list, None,
]
VALUES: list[Any] = [None, "s", 1, 1.5, [1, 2], ["a"], {"x": 1}, {"k": {"x": 1}}]


@pytest.mark.parametrize("annotation", ANNOTATIONS, ids=str)
def test_a_kept_annotation_returns_every_value_itself(annotation: Any) -> None:
    if _kept(annotation):
        for value in VALUES:
            assert _construct_value(annotation, value) is value
    else:  # something is rebuilt for at least one value shape
        assert any(_construct_value(annotation, v) is not v for v in VALUES)


def test_construct_builds_every_field_as_before() -> None:
    data = Outer(
        Name="n", kind="a", score=0.5, inner={"x": 1, "tags": ["t"]}, maybe={"x": 2},
        either={"y": "o"}, many=[{"x": 3}], pair=["p", "q"], by_key={"k": {"x": 4}},
        plain={"d": [1]}, words=["w"], blob={"any": [1]},
    ).model_dump(mode="json", by_alias=True)
    got = construct(Outer, data)
    expected = Outer.model_construct(**{
        name: _construct_value(info.annotation, data[info.alias or name])
        for name, info in Outer.model_fields.items()
    })
    assert got == expected
    assert isinstance(got.inner, Inner) and isinstance(got.many[0], Inner)
    assert isinstance(got.by_key["k"], Inner) and got.pair == ("p", "q")
    assert got.either == {"y": "o"}  # a union of two models stays a dict, as before
    assert got.words == data["words"] and got.words is not data["words"]  # a new list
    assert got.plain == data["plain"] and got.plain is not data["plain"]  # dict[str, Any] too
    assert got.blob is data["blob"]  # an Any field is kept as it is
    assert construct(Outer, data) == got  # the cached field plan gives the same again


def test_the_output_json_schema_is_a_fresh_copy_each_time() -> None:
    contract = OutputContract(Outer)
    first = contract.json_schema
    assert first == Outer.model_json_schema(by_alias=True)
    assert first is not None
    first["properties"].clear()
    assert contract.json_schema == Outer.model_json_schema()
    assert OutputContract(None).json_schema is None


# --- check_input: flat values without the walk ----------------------------------------------


def test_flat_inputs_are_kept_and_checked_as_before() -> None:
    item = {"n": 1, "f": 1.5, "b": True, "none": None, "s": "text é", "list": ["a", {"b": 2}]}
    assert check_input(item, 0) == item
    for bad, where in [
        ({"a": "x\ud800"}, "'a' contains a lone surrogate"),
        ({"k\ud800": 1}, "key 'k\\ud800' contains a lone surrogate"),
        ({"a": ["ok", "\ud800"]}, "'a'[1] contains a lone surrogate"),
        ({"a": {"b": "\ud800"}}, "'a'['b'] contains a lone surrogate"),
    ]:
        with pytest.raises(BatchSpecError, match="input 4") as info:
            check_input(bad, 4)
        assert where in str(info.value)
    with pytest.raises(BatchSpecError, match="cannot be stored as JSON"):
        check_input({"a": object()}, 0)


# --- the encoders made once -------------------------------------------------------------------


def test_the_shared_encoders_give_json_dumps_bytes_and_errors() -> None:
    value = {"b": [1, 2.5, None, True], "a": "é ✓", "c": {"z": 1, "y": "q"}}
    assert canonical_json(value) == json.dumps(value, sort_keys=True, separators=(",", ":"),
                                               ensure_ascii=False)
    assert encode_json(value, "t") == json.dumps(value, ensure_ascii=False).encode()
    messages = [{"role": "user", "content": "é ✓ text"}, {"role": "assistant", "content": "ok"}]
    compact = json.dumps(messages, separators=(",", ":"), ensure_ascii=False).encode()
    assert token_upper_bound(messages) == len(compact) + 2 * MESSAGE_OVERHEAD_TOKENS
    with pytest.raises(BadRequest, match="not JSON-serializable"):
        encode_json({"x": math.nan}, "t")
    with pytest.raises(BadRequest, match="not JSON-serializable"):
        encode_json({"x": object()}, "t")


def test_token_counts_read_as_before() -> None:
    def before(value: Any) -> int:  # _as_int without the exact-int shortcut
        if isinstance(value, bool):
            return 0
        if isinstance(value, int | float):
            return max(0, int(value))
        if isinstance(value, str):
            try:
                return max(0, int(float(value)))
            except ValueError:
                return 0
        return 0

    values = [5, -3, 0, 2**40, True, False, 2.7, -1.5, "12", "1e3", "x", None, [1]]
    assert [_as_int(v) for v in values] == [before(v) for v in values]
