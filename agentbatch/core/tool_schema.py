"""A tool's JSON schema and argument validator, both derived from its Python signature.

One pydantic model per tool does both jobs, so what the model is told (the schema) and what
the pool accepts (validation) cannot drift apart. Types come from ``typing.get_type_hints``,
so modules using ``from __future__ import annotations`` work. The schema must be
byte-stable: every agent of a batch sends it in the same cached prompt prefix, so it carries
no process-dependent content and titles (pure noise for the model) are stripped.
"""

from __future__ import annotations

import copy
import functools
import inspect
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from agentbatch.core.errors import BatchSpecError, ToolError
from agentbatch.core.model_io import canonical_json
from agentbatch.core.tool_context import ToolContext

if typing.TYPE_CHECKING:
    from agentbatch.core.tool import Tool

_SECTIONS = {
    "args", "arguments", "parameters", "params", "keyword args", "keyword arguments",
    "returns", "return", "yields", "yield", "raises", "examples", "example", "note", "notes",
    "attributes", "see also", "warning", "warnings", "todo", "references",
}  # fmt: skip
_ARG_SECTIONS = {"args", "arguments", "parameters", "params", "keyword args", "keyword arguments"}
_HEADER = re.compile(r"^([A-Za-z][A-Za-z ]*):\s*$")
_ENTRY = re.compile(r"^\*{0,2}([A-Za-z_]\w*)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "contains")


class ArgumentsInvalid(ToolError):
    """The model's arguments do not fit the tool's parameters; the message is for the model."""


@dataclass(frozen=True)
class ValidatedArgs:
    """Arguments after validation: Python values to call with, and their canonical JSON."""

    kwargs: dict[str, Any]  # the ToolContext parameter is not included
    canonical: str  # canonical_json of the JSON form, defaults included: the dedupe key part


@dataclass(frozen=True)
class ArgSpec:
    """Everything the pool needs to know about a tool's parameters."""

    model: type[BaseModel]
    params: tuple[tuple[str, str], ...]  # (model field name, Python parameter name)
    context_param: str | None
    description: str  # from the docstring, before its first section
    schema: dict[str, Any]

    def validate(self, arguments: Mapping[str, Any], *, tool_name: str) -> ValidatedArgs:
        """Validate the model's arguments, raising ``ArgumentsInvalid`` with a readable list."""
        if not isinstance(arguments, Mapping):
            raise ArgumentsInvalid(
                f"error: invalid arguments for tool {tool_name!r}: expected a JSON object, "
                f"got {type(arguments).__name__}"
            )
        try:
            inst = self.model.model_validate(dict(arguments))
        except ValidationError as exc:
            raise ArgumentsInvalid(_describe_errors(tool_name, exc)) from None
        kwargs = {param: getattr(inst, field) for field, param in self.params}
        kwargs.update(inst.model_extra or {})
        dumped = inst.model_dump(mode="json", by_alias=True)
        return ValidatedArgs(kwargs=kwargs, canonical=canonical_json(dumped))


def validate_arguments(tool: Tool, args: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments to call ``tool.fn`` with; raises ``ArgumentsInvalid``."""
    return tool.spec.validate(args, tool_name=tool.name).kwargs


def build_arg_spec(fn: Callable[..., Any], *, name: str,
                   localns: Mapping[str, Any] | None = None) -> ArgSpec:
    """Derive the validator model and JSON schema from ``fn``'s signature and docstring.

    ``localns`` resolves string annotations naming locals of the scope that defined ``fn``
    (``@tool`` passes its caller's locals, as pydantic does for models).
    """
    target = _hint_target(fn)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        raise BatchSpecError(f"tool {name!r}: cannot read the signature: {exc}") from None
    try:
        # ToolContext is offered so tools may import it under TYPE_CHECKING only.
        names = {"ToolContext": ToolContext, **(localns or {})}
        hints = typing.get_type_hints(target, localns=names, include_extras=True)
    except Exception as exc:
        raise BatchSpecError(
            f"tool {name!r}: cannot resolve its type hints ({type(exc).__name__}: {exc}); "
            "annotation names must be importable from the function's module"
        ) from None
    description, arg_docs = parse_docstring(_docstring(fn, target))

    fields: dict[str, tuple[Any, dict[str, Any]]] = {}
    params: list[tuple[str, str]] = []
    context_param: str | None = None
    extra: Literal["allow", "forbid"] = "forbid"
    for param in sig.parameters.values():
        if param.kind is param.VAR_POSITIONAL:
            continue  # never filled: the model only sends keyword arguments
        if param.kind is param.VAR_KEYWORD:
            extra = "allow"
            continue
        if param.kind is param.POSITIONAL_ONLY:
            raise BatchSpecError(
                f"tool {name!r}: positional-only parameter {param.name!r} is not supported"
            )
        annotation = hints.get(param.name, Any)
        if _is_context(annotation):
            context_param = param.name
            continue
        info: dict[str, Any] = {"alias": param.name}
        if param.name in arg_docs:
            info["description"] = arg_docs[param.name]
        if param.default is not param.empty:
            info["default"] = param.default
        # Internal field names dodge BaseModel attribute clashes (``json``, ``model_*``, ``_x``).
        field_name = f"p{len(params)}"
        fields[field_name] = (annotation, info)
        params.append((field_name, param.name))

    key = _fields_key(fields)
    try:
        if key is None:  # an unhashable annotation or default: build it afresh
            model, schema = _build_model(name, extra, fields)
        else:
            model, schema = _cached_model(name, extra, key)
    except (pydantic.PydanticUserError, pydantic.PydanticSchemaGenerationError, TypeError) as exc:
        raise BatchSpecError(f"tool {name!r}: unsupported parameter type: {exc}") from None
    return ArgSpec(model=model, params=tuple(params), context_param=context_param,
                   description=description, schema=copy.deepcopy(schema))


FieldsKey = tuple[tuple[str, Any, tuple[tuple[str, Any], ...]], ...]


def _fields_key(fields: dict[str, tuple[Any, Any]]) -> FieldsKey | None:
    """A hashable form of the model's fields, or None when one of them is not hashable.

    Tools built from one factory (a closure per batch, ``read_file_tool(root)``) have equal
    fields; building their pydantic model once saves about a millisecond per build. A
    default's type is part of the key, since ``1 == True`` would otherwise share a model.
    """
    out = []
    for field_name, (annotation, info) in fields.items():
        items = tuple(sorted((k, v) for k, v in info.items() if k != "default"))
        if "default" in info:
            items += (("default", (type(info["default"]), info["default"])),)
        out.append((field_name, annotation, items))
    key = tuple(out)
    try:
        hash(key)
    except TypeError:
        return None
    return key


@functools.lru_cache(maxsize=256)
def _cached_model(name: str, extra: Literal["allow", "forbid"],
                  key: FieldsKey) -> tuple[type[BaseModel], dict[str, Any]]:
    fields = {}
    for field_name, annotation, items in key:
        info = dict(items)
        if "default" in info:
            info["default"] = info["default"][1]
        fields[field_name] = (annotation, info)
    return _build_model(name, extra, fields)


def _build_model(name: str, extra: Literal["allow", "forbid"],
                 fields: dict[str, tuple[Any, Any]]) -> tuple[type[BaseModel], dict[str, Any]]:
    """The arguments' pydantic model and its JSON schema (titles and description dropped)."""
    config = ConfigDict(extra=extra, protected_namespaces=(), populate_by_name=False)
    definitions: dict[str, Any] = {k: (annotation, Field(**info))
                                   for k, (annotation, info) in fields.items()}
    model = create_model(f"{_model_name(name)}Arguments", __config__=config, **definitions)
    schema = _strip_titles(model.model_json_schema(by_alias=True))
    schema.pop("description", None)  # the function description lives beside the schema
    schema.setdefault("properties", {})
    return model, schema


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """Split a Google-style docstring into (text before the first section, {arg: description})."""
    if not doc:
        return "", {}
    desc: list[str] = []
    args: dict[str, str] = {}
    section: str | None = None
    entry_indent: int | None = None
    current: str | None = None
    for line in inspect.cleandoc(doc).splitlines():
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        header = _HEADER.match(line)
        if header and header.group(1).strip().lower() in _SECTIONS:
            section, entry_indent, current = header.group(1).strip().lower(), None, None
            continue
        if section is None:
            desc.append(line)
            continue
        if not stripped or section not in _ARG_SECTIONS:
            continue
        if indent == 0:  # dedented text ends the section
            section = "end"
            continue
        if entry_indent is None:
            entry_indent = indent
        entry = _ENTRY.match(stripped) if indent <= entry_indent else None
        if entry:
            current = entry.group(1)
            args[current] = entry.group(2).strip()
        elif current is not None:
            args[current] = f"{args[current]} {stripped}".strip()
    return "\n".join(desc).strip(), args


def _describe_errors(tool_name: str, exc: ValidationError) -> str:
    """pydantic's messages, one per line, without its documentation links."""
    lines = [f"error: invalid arguments for tool {tool_name!r}:"]
    for err in exc.errors(include_url=False):
        loc = ".".join(str(p) for p in err.get("loc", ())) or "(arguments)"
        line = f"- {loc}: {err.get('msg', 'invalid')}"
        if err.get("type") not in ("missing",) and "input" in err:
            shown = repr(err["input"])
            line += f" (got {shown[:80] + '...' if len(shown) > 80 else shown})"
        lines.append(line)
    return "\n".join(lines)


def _hint_target(fn: Callable[..., Any]) -> Any:
    """The object whose annotations and globals describe ``fn`` (unwrapping decorators)."""
    target: Any = inspect.unwrap(fn)
    while isinstance(target, functools.partial):
        target = inspect.unwrap(target.func)
    if callable(target) and not (inspect.isroutine(target) or inspect.isclass(target)):
        target = type(target).__call__  # a callable instance: its __call__ is annotated
    return target


def _docstring(fn: Callable[..., Any], target: Any) -> str | None:
    doc = target.__doc__ if inspect.isfunction(target) or inspect.ismethod(target) else None
    return doc or inspect.getdoc(fn)  # e.g. a callable instance: its class documents it


def _is_context(annotation: Any) -> bool:
    if annotation is ToolContext:
        return True
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _is_context(typing.get_args(annotation)[0])
    if origin is typing.Union or origin is types.UnionType:
        return ToolContext in typing.get_args(annotation)
    return False


def _model_name(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in re.split(r"[^A-Za-z0-9]+", name)) or "T"


def _strip_titles(schema: Any) -> Any:
    """Drop auto-generated ``title`` keys (not properties *named* title) throughout a schema."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "title" and isinstance(value, str):
            continue
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: _strip_titles(v) for k, v in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [_strip_titles(v) for v in value]
        elif key in _SCHEMA_ONE:
            out[key] = _strip_titles(value)
        else:
            out[key] = value
    return out
