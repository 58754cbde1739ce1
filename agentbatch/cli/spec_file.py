"""The batch spec file of ``agentbatch run``: a YAML mapping validated by a Pydantic model.

Besides its own keys (``task``, ``inputs``, ``output``, and ``tools``/``output_schema`` as
import paths), a spec takes any keyword of ``submit_batch``; those values are checked by
``submit_batch`` itself, so the parameter list lives in one place. Every error names the file,
and the line for a bad JSONL input.
"""

from __future__ import annotations

import csv
import inspect
import io
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from agentbatch.core.aliases import suggest
from agentbatch.core.errors import BatchSpecError

EXAMPLE = """\
task: "Summarise the file at {path} in one sentence."
# a .jsonl (a JSON object a line), .csv or .json file, or a list of dicts
inputs: inputs.jsonl
model: Qwen/Qwen2.5-7B-Instruct
backend: vllm://gpu-0:8000
# optional: "module:attr" paths of @tool functions and of a Pydantic model
tools:
  - agentbatch.toolpool.builtins:read_file
output_schema: mypkg.schemas:Summary
# optional: where results go (default: <spec name>.results.jsonl)
output: results.jsonl
# optional: any other submit_batch keyword
max_turns: 6
"""

# submit_batch keywords a YAML file cannot express (a callable) or that the spec handles.
_NOT_IN_SPEC = {"task", "inputs", "on_result", "tools", "output_schema"}


def _submit_keywords() -> list[str]:
    from agentbatch.api import submit_batch

    return [p for p in inspect.signature(submit_batch).parameters if p not in _NOT_IN_SPEC]


class BatchSpec(BaseModel):
    """A spec file. Keys other than the fields below must be ``submit_batch`` keywords."""

    model_config = ConfigDict(extra="allow")

    task: str = Field(description="the str.format template rendered with each input")
    inputs: list[dict[str, Any]] | str = Field(
        description="a list of dicts, or a .jsonl/.csv/.json path relative to the spec")
    output: str | None = Field(None, description="results JSONL path (relative to the cwd)")
    tools: list[str] = Field(default_factory=list, description='"module:attr" tool paths')
    output_schema: str | None = Field(None, description='"module:Class" of a Pydantic model')

    @model_validator(mode="after")
    def _known_keys(self) -> BatchSpec:
        allowed = _submit_keywords()
        for key in self.model_extra or {}:
            if key not in allowed:
                close = suggest(key, [*allowed, *self.model_fields])
                hint = f" (did you mean {close!r}?)" if close else ""
                raise ValueError(f"unknown key {key!r}{hint}")
        return self

    def submit_kwargs(self) -> dict[str, Any]:
        """The keywords for ``submit_batch``, with ``output_schema`` imported."""
        kwargs = dict(self.model_extra or {})
        if self.tools:
            kwargs["tools"] = self.tools
        if self.output_schema:
            from agentbatch.turnloop.runtime import import_object

            try:
                kwargs["output_schema"] = import_object(self.output_schema)
            except Exception as exc:
                raise BatchSpecError(f"output_schema {self.output_schema!r} could not be "
                                     f"imported: {type(exc).__name__}: {exc}") from None
        return kwargs


def _read(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise BatchSpecError(f"{what} {path} not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BatchSpecError(f"{what} {path} could not be read: {exc}") from None


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts)


def load_spec(path: Path) -> BatchSpec:
    """Parse and validate a spec file; ``BatchSpecError`` names the file and the problem."""
    import yaml

    try:
        raw = yaml.safe_load(_read(path, "spec file"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise BatchSpecError(f"{path}{where}: not valid YAML: {problem}") from None
    if not isinstance(raw, dict):
        got = "an empty file" if raw is None else f"a {type(raw).__name__}"
        raise BatchSpecError(f"{path}: a spec must be a mapping with at least 'task' and "
                             f"'inputs', got {got}; see `agentbatch run --help`")
    try:
        return BatchSpec.model_validate(raw)
    except ValidationError as exc:
        raise BatchSpecError(f"{path}: {_describe(exc)}") from None


def _jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    for lineno, line in enumerate(_read(path, "inputs file").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BatchSpecError(f"{path} line {lineno}: not valid JSON: {exc.msg} "
                                 f"(column {exc.colno})") from None
        if not isinstance(row, dict):
            raise BatchSpecError(f"{path} line {lineno}: each line must be a JSON object, "
                                 f"got {type(row).__name__}")
        rows.append(row)
    return rows


def load_inputs(spec: BatchSpec, base: Path) -> list[dict[str, Any]]:
    """The spec's inputs: inline, or read from a file relative to the spec's folder."""
    if isinstance(spec.inputs, list):
        return spec.inputs
    path = (base / spec.inputs).resolve()
    if path.suffix == ".csv":
        return list(csv.DictReader(io.StringIO(_read(path, "inputs file"), newline="")))
    if path.suffix == ".json":
        try:
            rows = json.loads(_read(path, "inputs file"))
        except json.JSONDecodeError as exc:
            raise BatchSpecError(f"{path} line {exc.lineno}: not valid JSON: {exc.msg}") \
                from None
        if not isinstance(rows, list):
            raise BatchSpecError(f"{path}: must hold a JSON list of objects")
        return rows
    return _jsonl(path)
