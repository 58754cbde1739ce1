"""Schema derivation and argument validation for @tool functions.

This module uses ``from __future__ import annotations`` on purpose: every annotation below is a
string at runtime, which the predecessor's schema builder could not handle.
"""

from __future__ import annotations

import enum
import pickle
from typing import Any, Literal, Optional, Union

import pytest
from pydantic import BaseModel

from agentbatch.core.errors import BatchSpecError
from agentbatch.core.model_io import canonical_json
from agentbatch.core.tool_schema import parse_docstring
from agentbatch.toolpool import (
    ArgumentsInvalid,
    Tool,
    ToolContext,
    resolve_tool,
    tool,
    validate_arguments,
)


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Point(BaseModel):
    x: int
    y: int = 0


@tool
def everything(
    name: str,
    count: int,
    ratio: float,
    flag: bool,
    tags: list[str],
    weights: dict[str, float],
    maybe: Optional[int] = None,  # noqa: UP045 - the old spelling must work too
    either: Union[int, str] = 1,  # noqa: UP007
    pipe: int | None = None,
    mode: Literal["fast", "slow"] = "fast",
    color: Color = Color.RED,
    point: Point | None = None,
    anything=None,
) -> str:
    """Exercise every supported parameter type.

    A second paragraph that is also part of the description.

    Args:
        name: The name to use.
        count (int): How many; a description that
            continues on the next line.
        mode: Speed.

    Returns:
        Nothing interesting.
    """
    return "ok"


@tool
async def with_context(query: str, ctx: ToolContext) -> str:
    """Look something up.

    Args:
        query: What to look up.
        ctx: Injected; must not appear in the schema.
    """
    return ctx.idempotency_key


@tool(name="renamed", cacheable=True, rate_limit=2.0, timeout=3.0, description="Custom text.")
def options_tool(a: int) -> int:
    """Ignored docstring."""
    return a


@tool
def clashing(json: str, model_config: int = 0, schema: str = "s", title: str = "t") -> str:
    """Parameter names that clash with BaseModel attributes (or schema keywords) must work.

    Args:
        title: A parameter literally named title survives title stripping.
    """
    return f"{json}:{model_config}:{schema}"


def props(t: Tool) -> dict[str, Any]:
    return t.parameters["properties"]


def test_types_from_future_annotations() -> None:
    p = props(everything)
    assert p["name"]["type"] == "string"
    assert p["count"]["type"] == "integer"
    assert p["ratio"]["type"] == "number"
    assert p["flag"]["type"] == "boolean"
    assert p["tags"] == {"type": "array", "items": {"type": "string"}}
    assert p["weights"] == {"type": "object", "additionalProperties": {"type": "number"}}
    assert {"type": "null"} in p["maybe"]["anyOf"]
    assert p["maybe"]["default"] is None
    assert {"type": "integer"} in p["either"]["anyOf"]
    assert {"type": "string"} in p["either"]["anyOf"]
    assert {"type": "null"} in p["pipe"]["anyOf"]
    assert p["mode"]["enum"] == ["fast", "slow"]
    assert p["mode"]["default"] == "fast"
    assert p["color"]["default"] == "red"
    defs = everything.parameters["$defs"]
    assert defs["Color"]["enum"] == ["red", "blue"]
    assert defs["Point"]["properties"]["x"] == {"type": "integer"}
    assert "anything" in p
    required = everything.parameters["required"]
    assert required == ["name", "count", "ratio", "flag", "tags", "weights"]
    assert everything.parameters["type"] == "object"
    assert everything.parameters["additionalProperties"] is False


def test_no_titles_anywhere() -> None:
    text = canonical_json(everything.parameters)
    assert '"title"' not in text


def test_descriptions_from_docstring() -> None:
    assert everything.description.startswith("Exercise every supported parameter type.")
    assert "second paragraph" in everything.description
    assert "Returns" not in everything.description
    p = props(everything)
    assert p["name"]["description"] == "The name to use."
    assert p["count"]["description"] == "How many; a description that continues on the next line."
    assert p["mode"]["description"] == "Speed."
    assert "description" not in p["ratio"]


def test_tool_context_is_excluded_and_detected() -> None:
    assert list(props(with_context)) == ["query"]
    assert with_context.parameters["required"] == ["query"]
    assert with_context.spec.context_param == "ctx"
    assert "ctx" not in canonical_json(with_context.openai_schema())


def test_openai_schema_shape_and_options() -> None:
    s = options_tool.openai_schema()
    assert s == {
        "type": "function",
        "function": {
            "name": "renamed",
            "description": "Custom text.",
            "parameters": options_tool.parameters,
        },
    }
    assert options_tool.cacheable and options_tool.rate_limit == 2.0
    assert options_tool.timeout == 3.0
    s["function"]["parameters"]["properties"].clear()  # a copy: the tool is not corrupted
    assert "a" in props(options_tool)


def test_schema_is_byte_stable() -> None:
    first = canonical_json(everything.openai_schema())
    again = tool(everything.fn)  # rebuilt from scratch
    assert canonical_json(again.openai_schema()) == first
    assert canonical_json(everything.openai_schema()) == first


def test_decorated_function_stays_callable() -> None:
    assert options_tool(5) == 5
    assert clashing("j") == "j:0:s"


def test_import_path_and_resolve() -> None:
    assert everything.import_path == f"{__name__}:everything"
    assert options_tool.import_path == f"{__name__}:options_tool"

    def local(a: int) -> int:
        return a

    assert tool(local).import_path is None
    assert resolve_tool(everything) is everything
    assert resolve_tool("agentbatch.toolpool.builtins:web_search") is Tool.web_search


def test_resolve_tool_errors_name_the_tool() -> None:
    with pytest.raises(BatchSpecError, match="no_such_module_xyz"):
        resolve_tool("no_such_module_xyz:thing")
    with pytest.raises(BatchSpecError, match="missing_attr"):
        resolve_tool("agentbatch.toolpool.builtins:missing_attr")
    with pytest.raises(BatchSpecError, match="not a Tool"):
        resolve_tool("agentbatch.toolpool.builtins:read_confined")
    with pytest.raises(BatchSpecError, match="module:attr"):
        resolve_tool("no-colon")


def test_pickle_reimports_by_path() -> None:
    assert pickle.loads(pickle.dumps(Tool.read_file)) is Tool.read_file


def test_validate_arguments_converts_and_fills_defaults() -> None:
    kwargs = validate_arguments(
        everything,
        {"name": "n", "count": "3", "ratio": 1, "flag": True, "tags": ["a"],
         "weights": {"w": 1}, "color": "blue", "point": {"x": 1}},
    )
    assert kwargs["count"] == 3
    assert kwargs["color"] is Color.BLUE
    assert kwargs["point"] == Point(x=1, y=0)
    assert kwargs["mode"] == "fast"
    assert kwargs["anything"] is None


def test_validate_arguments_error_is_readable() -> None:
    with pytest.raises(ArgumentsInvalid) as info:
        validate_arguments(options_tool, {"a": "not a number", "extra": 1})
    msg = str(info.value)
    assert "renamed" in msg
    assert "a: Input should be a valid integer" in msg
    assert "extra" in msg
    assert "errors.pydantic.dev" not in msg
    with pytest.raises(ArgumentsInvalid, match="Field required"):
        validate_arguments(options_tool, {})


def test_clashing_names_validate_by_parameter_name() -> None:
    assert list(props(clashing)) == ["json", "model_config", "schema", "title"]
    assert props(clashing)["title"]["description"].startswith("A parameter literally")
    assert validate_arguments(clashing, {"json": "x", "schema": "y"}) == {
        "json": "x", "model_config": 0, "schema": "y", "title": "t",
    }


def test_canonical_key_includes_defaults() -> None:
    a = options_tool.spec.validate({"a": 1}, tool_name="renamed")
    b = options_tool.spec.validate({"a": "1"}, tool_name="renamed")
    assert a.canonical == b.canonical == '{"a":1}'
    c = clashing.spec.validate({"json": "x"}, tool_name="clashing")
    d = clashing.spec.validate({"json": "x", "title": "t", "model_config": 0}, tool_name="c")
    assert c.canonical == d.canonical


def test_kwargs_accepts_extra_arguments() -> None:
    def loose(a: int, **rest: Any) -> str:
        return "ok"

    t = tool(loose)
    assert validate_arguments(t, {"a": 1, "b": 2}) == {"a": 1, "b": 2}
    assert t.parameters["additionalProperties"] is True


def test_direct_construction_derives_schema() -> None:
    def f(x: int) -> int:
        """Double it."""
        return 2 * x

    t = Tool(name="double", fn=f)
    assert t.description == "Double it."
    assert props(t) == {"x": {"type": "integer"}}


def test_bad_definitions_raise_batch_spec_error() -> None:
    def f(x: int) -> int:
        return x

    with pytest.raises(BatchSpecError, match="tool name"):
        tool(name="has space")(f)
    with pytest.raises(BatchSpecError, match="rate_limit"):
        tool(rate_limit=0)(f)
    with pytest.raises(BatchSpecError, match="object JSON schema"):
        Tool(name="f", fn=f, parameters={"type": "string"})


def test_unresolvable_annotation_names_the_tool() -> None:
    def f(x: NotDefinedAnywhere) -> int:  # type: ignore[name-defined]  # noqa: F821
        return 1

    with pytest.raises(BatchSpecError, match="'f'"):
        tool(f)


def test_parse_docstring_variants() -> None:
    desc, args = parse_docstring(
        """Summary line.

        Arguments:
            a (int, optional): First.
            *args: Ignored.
            b: Second,
                continued.

        Raises:
            ValueError: never.
        """
    )
    assert desc == "Summary line."
    assert args == {"a": "First.", "args": "Ignored.", "b": "Second, continued."}
    assert parse_docstring(None) == ("", {})


def test_nested_tool_with_local_model_under_future_annotations() -> None:
    class Local(BaseModel):
        v: int

    @tool
    def uses_local(item: Local, ctx: ToolContext) -> int:
        return item.v

    assert uses_local.parameters["properties"]["item"] == {"$ref": "#/$defs/Local"}
    assert validate_arguments(uses_local, {"item": {"v": "2"}}) == {"item": Local(v=2)}


# -- tools built by one factory share the argument model, never its mutable parts ------------


def _factory(default: Any) -> Any:
    def lookup(key: str, limit: int = default) -> str:
        """Look a key up.

        Args:
            key: what to look up.
        """
        return key

    return lookup


def test_tools_from_one_factory_share_the_model_and_own_their_schema() -> None:
    a, b = Tool(name="lookup", fn=_factory(3)), Tool(name="lookup", fn=_factory(3))
    assert a.spec.model is b.spec.model  # built once
    assert a.spec.schema == b.spec.schema and a.spec.schema is not b.spec.schema
    a.parameters["properties"]["key"]["description"] = "changed"
    a.spec.schema["properties"].clear()
    assert b.parameters["properties"]["key"]["description"] == "what to look up."
    assert Tool(name="lookup", fn=_factory(3)).spec.schema["properties"]  # the cache unharmed
    assert validate_arguments(b, {"key": "k"}) == {"key": "k", "limit": 3}


@pytest.mark.parametrize(("first", "second"), [(3, 4), (1, True)])
def test_a_different_default_is_a_different_model(first: Any, second: Any) -> None:
    a, b = Tool(name="lookup", fn=_factory(first)), Tool(name="lookup", fn=_factory(second))
    assert a.spec.model is not b.spec.model
    assert validate_arguments(a, {"key": "k"})["limit"] is first
    assert validate_arguments(b, {"key": "k"})["limit"] is second


def test_an_unhashable_default_is_built_afresh() -> None:
    def make(default: list[int]) -> Any:
        def pick(items: list[int] = default) -> int:
            return len(items)

        return pick

    a, b = Tool(name="pick", fn=make([1])), Tool(name="pick", fn=make([1, 2]))
    assert a.spec.model is not b.spec.model
    assert validate_arguments(b, {}) == {"items": [1, 2]}


def test_same_name_other_signature_is_another_model() -> None:
    def first(key: str) -> str:
        return key

    def second(key: int) -> int:
        return key

    a, b = Tool(name="same", fn=first), Tool(name="same", fn=second)
    assert a.spec.model is not b.spec.model
    with pytest.raises(ArgumentsInvalid):
        validate_arguments(b, {"key": "not a number"})
