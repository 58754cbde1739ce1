"""The output contract of a batch: how a final reply becomes a validated value."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from ..model_io import canonical_json
from .repair import RepairError, extract_json

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
        return self.schema.model_json_schema() if self.schema else None

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
        """The user-facing output object for a stored JSON value."""
        if self.schema is None or value is None:
            return value
        return self.schema.model_validate(value)


def _short(message: str) -> str:
    return message if len(message) <= _MAX_ERROR_CHARS else message[:_MAX_ERROR_CHARS] + " …"
