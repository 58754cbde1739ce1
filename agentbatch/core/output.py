"""The output contract of a batch: how a final reply becomes a validated value."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, get_args, get_origin

from pydantic import BaseModel, ValidationError

from agentbatch.core.model_io import canonical_json
from agentbatch.core.repair import RepairError, extract_json

_MAX_ERROR_CHARS = 1200


@dataclass(frozen=True)
class ParsedOutput:
    ok: bool
    value: Any = None  # JSON-ready value (a dict for schema outputs, the text otherwise)
    error: str | None = None


class OutputContract:
    """Validates final replies against ``schema`` (a Pydantic model), or accepts free text."""

    def __init__(self, schema: type[BaseModel] | None) -> None:
        self.schema = schema

    @property
    def json_schema(self) -> dict[str, Any] | None:
        """The schema's JSON schema, a new copy on each call."""
        return copy.deepcopy(_json_schema(self.schema)) if self.schema else None

    @property
    def name(self) -> str | None:
        return self.schema.__name__ if self.schema else None

    def instructions(self) -> str:
        """Schema instructions for the shared system prompt (byte-identical for a batch)."""
        if self.schema is None:
            return ""
        return (
            "When you give your final answer, reply with only a JSON object that matches "
            "this JSON schema, with no other text:\n```json\n"
            f"{canonical_json(self.json_schema)}\n```"
        )

    def parse(self, text: str | None) -> ParsedOutput:
        if self.schema is None:
            if text is None or not text.strip():
                return ParsedOutput(False, error="the reply was empty")
            return ParsedOutput(True, value=text)
        try:
            raw = extract_json(text)
        except RepairError as exc:
            return ParsedOutput(False, error=str(exc))
        try:
            obj = self.schema.model_validate(raw)
        except ValidationError as exc:
            return ParsedOutput(False, error=_short(str(exc)))
        return ParsedOutput(True, value=obj.model_dump(mode="json"))

    def instance(self, value: Any) -> Any:
        """The user-facing output object for a stored, already validated JSON value.

        Validation ran once, where the reply was parsed; its result is what was stored. The
        object is rebuilt here without running validators again (``construct``), so a
        validator that transforms its input (renames or upper-cases a field) is not applied
        twice. Fields keep their JSON form where it differs (a ``datetime`` stays a string).
        """
        if self.schema is None or value is None:
            return value
        return construct(self.schema, value)


@functools.lru_cache(maxsize=64)
def _json_schema(schema: type[BaseModel]) -> dict[str, Any]:
    """``schema.model_json_schema()``, made once per model: pydantic builds it anew on every
    call, and every batch asks about three times (issue 26 item 5). Callers get copies."""
    return schema.model_json_schema()


def construct(model: type[BaseModel], data: Any) -> Any:
    """``model`` built from its validated dump, nested models included, with no validators."""
    if not isinstance(data, dict):
        return data
    values: dict[str, Any] = {}
    for name, alias, convert in _fields(model):
        key = alias if alias and alias in data else name
        if key in data:
            values[name] = data[key] if convert is None else convert(data[key])
    return model.model_construct(**values)


_Convert = Callable[[Any], Any] | None  # None: the value is kept as it is


@functools.lru_cache(maxsize=256)
def _fields(model: type[BaseModel]) -> tuple[tuple[str, str | None, _Convert], ...]:
    """Each field's name, alias and how its value is built (``_converter``), worked out once
    per model: every ended agent's output is built here (issue 26 item 5)."""
    return tuple((name, info.alias, _converter(info.annotation))
                 for name, info in model.model_fields.items())


def _converter(annotation: Any) -> _Convert:
    """What ``_construct_value(annotation, value)`` does to a value, or None where it returns
    every value itself (``str``, ``float``, ``Literal``, a union of no or several models)."""
    if _kept(annotation):
        return None
    return lambda value: _construct_value(annotation, value)


def _kept(annotation: Any) -> bool:
    """``_construct_value(annotation, value) is value`` for every value (its branches, read
    off the annotation: a collection is always rebuilt, so it is not kept)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return False
    origin, args = get_origin(annotation), get_args(annotation)
    if not args:
        return True
    if origin in (list, tuple, set, frozenset) or (origin is dict and len(args) == 2):
        return False
    if origin in (list, tuple, set, frozenset, dict):
        return True
    return sum(isinstance(a, type) and issubclass(a, BaseModel) for a in args) != 1


def _construct_value(annotation: Any, value: Any) -> Any:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return construct(annotation, value)
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (list, tuple, set, frozenset) and args and isinstance(value, list):
        inner = args[0]
        items = [_construct_value(inner, v) for v in value]
        return items if origin is list else origin(items)
    if origin is dict and len(args) == 2 and isinstance(value, dict):
        return {k: _construct_value(args[1], v) for k, v in value.items()}
    if args and origin not in (list, tuple, set, frozenset, dict):  # Optional / Union
        models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        if len(models) == 1 and isinstance(value, dict):
            return construct(models[0], value)
    return value


def _short(message: str) -> str:
    return message if len(message) <= _MAX_ERROR_CHARS else message[:_MAX_ERROR_CHARS] + " …"
