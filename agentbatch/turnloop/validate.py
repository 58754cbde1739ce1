"""Check every public batch parameter at submit, before anything is compiled, sent or enqueued.

Both engines call ``check_options`` and ``check_inputs`` first (from ``compile_batch``). Each
failure is a ``BatchSpecError`` that names the parameter, and the input index where one
applies. A value that slips through would fail later, once per agent, or as a raw
``TypeError`` (docs/design-notes.md).
"""

from __future__ import annotations

import inspect
import math
import os
import re
import typing
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticSerializationError, to_json

from agentbatch.backends.hedge import check_hedge_after
from agentbatch.backends.pool import check_pool_options
from agentbatch.backends.urls import BackendTarget
from agentbatch.core.compaction import check_compaction
from agentbatch.core.errors import BatchSpecError, ConfigError
from agentbatch.core.options import BatchOptions, Pricing
from agentbatch.core.pricing import load_prices
from agentbatch.core.redis_url import check_url
from agentbatch.metrics.server import check_metrics_port
from agentbatch.toolpool import Tool
from agentbatch.turnloop.json_tool_calling import check_mode as check_tool_calling
from agentbatch.turnloop.tool_choice import check_required_tool_rounds
from agentbatch.turnloop.tool_choice import check_value as check_tool_choice


def show(value: Any, limit: int = 60) -> str:
    """A short repr for error messages."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- scalars ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Range:
    """What a numeric parameter accepts: an int or a finite number, at or above ``low``."""

    integer: bool
    low: float
    above: bool = False  # the value must be > low (else >= low)
    optional: bool = False  # None is accepted

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.optional
        kinds = (int,) if self.integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value):
            return False
        return value > self.low if self.above else value >= self.low

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a finite number"
        bound = f"{'>' if self.above else '>='} {self.low:g}"
        return f"{kind} {bound}{' or None' if self.optional else ''}"


_NUMBERS = {
    "max_turns": _Range(integer=True, low=1),
    "max_retries": _Range(integer=True, low=0),
    "max_inflight": _Range(integer=True, low=1, optional=True),
    "max_tokens": _Range(integer=True, low=1, optional=True),
    "max_server_waiting": _Range(integer=True, low=0, optional=True),
    "max_tool_calls_per_turn": _Range(integer=True, low=1),
    "max_tool_output_chars": _Range(integer=True, low=1),
    "required_tool_rounds": _Range(integer=True, low=1),
    "max_context_tokens": _Range(integer=True, low=1, optional=True),
    "timeout_per_turn": _Range(integer=False, low=0, above=True, optional=True),
    "timeout_per_tool": _Range(integer=False, low=0, above=True, optional=True),
    "temperature": _Range(integer=False, low=0, optional=True),
}
_FLAGS = ("native_json_schema", "warm_prefix", "batch_prompting", "keep_transcript")


def _check_numbers(opts: BatchOptions) -> None:
    for name, rule in _NUMBERS.items():
        value = getattr(opts, name)
        if not rule.accepts(value):
            raise BatchSpecError(f"{name} must be {rule.describe()}, got {show(value)}")
    for name in _FLAGS:
        value = getattr(opts, name)
        if not isinstance(value, bool):
            raise BatchSpecError(f"{name} must be True or False, got {show(value)}")


def check_text(where: str, text: str) -> None:
    """Refuse lone surrogates: they cannot be encoded as UTF-8, so no request could carry them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        raise BatchSpecError(
            f"{where} contains a lone surrogate {bad!r} at position {exc.start}, which is not "
            "valid Unicode (decode the source text with errors='replace')") from None


def _check_string(name: str, value: Any, *, optional: bool, empty_ok: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str) or (not empty_ok and not value.strip()):
        what = "a string" if empty_ok else "a non-empty string"
        raise BatchSpecError(f"{name} must be {what}{' or None' if optional else ''}, "
                             f"got {show(value)}")
    check_text(name, value)


def _check_redis_url(value: Any) -> None:
    if value is None:
        return
    if not isinstance(value, str) or not value:
        raise BatchSpecError(f"redis_url must be a URL such as 'redis://host:6379/0' or None, "
                             f"got {show(value)}")
    try:
        check_url(value)
    except ConfigError as exc:
        raise BatchSpecError(f"redis_url: {exc}") from None


def _check_backend(backend: Any) -> None:
    urls = [backend] if isinstance(backend, str) else backend
    if (not isinstance(urls, list | tuple) or not urls
            or not all(isinstance(u, str) and u for u in urls)):
        raise BatchSpecError("backend must be a URL such as 'vllm://host:8000' or a non-empty "
                             f"list of URLs, got {show(backend)}")


# Hosted APIs serve their own models: a pool may not mix one with any other kind of server.
_OWN_MODELS = ("openai", "anthropic", "bedrock")


def check_pool(targets: list[BackendTarget]) -> None:
    """A pool (several backend URLs, hostfiles expanded) must name distinct servers of one
    model: the same server twice would be routed as two (double its share of turns, and its
    agents split over two names), and a hosted API mixed with another kind of server cannot
    serve the model the other does."""
    seen: dict[str, str] = {}
    for t in targets:
        where = t.display if t.scheme == "bedrock" else t.base_url.lower()
        if where in seen:
            raise BatchSpecError(f"backend lists the same server twice: {seen[where]} and "
                                 f"{t.display}; list each server of a pool once")
        seen[where] = t.display
    kinds = {t.scheme for t in targets}
    hosted = sorted(kinds & set(_OWN_MODELS))
    if hosted and len(kinds) > 1:
        raise BatchSpecError(
            f"backend mixes {hosted[0]}:// with {', '.join(sorted(kinds - {hosted[0]}))}: a "
            f"pool's servers must serve one model, and {hosted[0]} serves only its own; use "
            "one kind of hosted API per batch")


def check_schema(schema: Any) -> None:
    if schema is None:
        return
    if not (inspect.isclass(schema) and issubclass(schema, BaseModel)):
        raise BatchSpecError(
            f"output_schema must be a Pydantic model class (a BaseModel subclass) or None, "
            f"got {show(schema)}"
        )


def check_tools(tools: Any) -> list[Tool | str]:
    """The ``tools`` argument as a list: ``Tool`` objects or "module:attr" paths."""
    if tools is None:
        return []
    if isinstance(tools, str | Tool) or callable(tools):
        tools = [tools]
    if not isinstance(tools, list | tuple):
        raise BatchSpecError("tools must be a list of @tool functions or 'module:attr' import "
                             f"paths, got {show(tools)}")
    for i, obj in enumerate(tools):
        if isinstance(obj, Tool | str):
            continue
        if callable(obj):
            name = getattr(obj, "__qualname__", None) or show(obj)
            raise BatchSpecError(
                f"tools[{i}]: {name} is a plain function, not a Tool; decorate a function "
                "defined at module level with @tool (lambdas and nested functions cannot be "
                "imported by workers)")
        raise BatchSpecError(f"tools[{i}] must be a @tool function or a 'module:attr' import "
                             f"path, got {show(obj)}")
    return list(tools)


_STREAM_ID = re.compile(r"\d{1,20}(-\d{1,20})?")


def check_cursor(after: Any) -> str:
    """A saved ``handle.cursor`` (a Redis stream id such as ``1700000000000-0``); None: start."""
    if after is None:
        return "0-0"
    if not isinstance(after, str) or not _STREAM_ID.fullmatch(after):
        raise BatchSpecError("after must be a cursor saved from handle.cursor, such as "
                             f"'1700000000000-0', or None, got {show(after)}")
    return after


_BATCH_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
BATCH_ID_RULE = "1 to 128 characters from A-Z a-z 0-9 . _ : -"


def check_batch_id(value: Any) -> str:
    """A batch id is part of every Redis key, log line and table row of its batch: only a
    short name of safe characters (no newline, NUL, ``}`` hash-tag end or ``*`` pattern)."""
    if not isinstance(value, str) or not _BATCH_ID.fullmatch(value):
        raise BatchSpecError(f"batch_id must be {BATCH_ID_RULE}, got {show(value)}")
    return value


def check_options(opts: BatchOptions) -> None:
    """Every parameter but ``inputs``; raises ``BatchSpecError`` naming the first bad one."""
    _check_string("task", opts.task, optional=False)
    _check_string("model", opts.model, optional=False)
    _check_string("system_prompt", opts.system_prompt, optional=True, empty_ok=True)
    if opts.batch_id is not None:
        check_batch_id(opts.batch_id)
    _check_redis_url(opts.redis_url)
    _check_backend(opts.backend)
    _check_numbers(opts)
    check_tools(opts.tools)
    check_schema(opts.output_schema)
    check_tool_calling(opts.tool_calling)
    check_tool_choice(opts.tool_choice, has_tools=bool(opts.tools))
    check_required_tool_rounds(opts.required_tool_rounds, opts.tool_choice, opts.max_turns)
    check_compaction(opts.compaction, opts.compaction_threshold)
    load_prices(opts.prices, opts.model)  # read and checked here; compile reads it again
    if opts.on_result is not None and not callable(opts.on_result):
        raise BatchSpecError(f"on_result must be a callable or None, got {show(opts.on_result)}")
    _check_checkpoint(opts)
    check_metrics_port(opts.metrics_port, opts.redis_url)
    _check_cost(opts)
    check_hedge_after(opts.hedge_after, opts.backend, pricing=opts.pricing)
    check_pool_options(opts.pool_routing, opts.pool_load_factor, opts.backend)


PRICINGS = typing.get_args(Pricing)


def deadline_in(deadline: Any) -> float | None:
    """Seconds from now to ``deadline`` (an aware datetime, or seconds from submit)."""
    if deadline is None:
        return None
    if isinstance(deadline, datetime):
        return (deadline - datetime.now(timezone.utc)).total_seconds()
    return float(deadline)


def _check_cost(opts: BatchOptions) -> None:
    """Caps, pricing and deadline (docs/cost.md): refused before anything is sent."""
    for name in ("max_cost_usd", "max_agent_cost_usd"):
        value = getattr(opts, name)
        if value is None:
            continue
        if (isinstance(value, bool) or not isinstance(value, int | float)
                or not math.isfinite(value) or value < 0):
            raise BatchSpecError(f"{name} must be a finite number >= 0 (US dollars) or None, "
                                 f"got {show(value)}")
        if opts.prices is None:
            raise BatchSpecError(f"{name} needs prices= (or AGENTBATCH_PRICES): without a "
                                 "price table no spend is known")
    if opts.pricing not in PRICINGS:
        raise BatchSpecError(f"pricing must be one of {', '.join(map(repr, PRICINGS))}, "
                             f"got {show(opts.pricing)}")
    _check_deadline(opts)
    if opts.pricing != "sync" and opts.prices is not None:
        entry = load_prices(opts.prices, opts.model)
        missing = [k for k in ("batch_prompt", "batch_completion")
                   if entry and k not in entry[str(opts.model)]]
        if missing:
            raise BatchSpecError(f"pricing={opts.pricing!r} prices turns at the batch rates: "
                                 f"prices[{opts.model!r}] needs {' and '.join(missing)}")


def _check_deadline(opts: BatchOptions) -> None:
    value = opts.deadline
    if value is None:
        if opts.pricing == "auto":
            raise BatchSpecError('pricing="auto" needs deadline= (an aware datetime, or '
                                 "seconds from submit): it trades cost against it")
        return
    if opts.pricing == "sync":
        raise BatchSpecError('deadline is for pricing="batch" or "auto"; with pricing="sync" '
                             "it would change nothing")
    if isinstance(value, datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            raise BatchSpecError(f"deadline must be timezone-aware, got {value.isoformat()} "
                                 "(e.g. datetime.now(timezone.utc) + timedelta(hours=6))")
    elif isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value):
        raise BatchSpecError(f"deadline must be an aware datetime or finite seconds from "
                             f"submit, got {show(value)}")
    left = deadline_in(value)
    if left is not None and left <= 0:
        raise BatchSpecError(f"deadline is in the past ({left:+.1f} s from now)")


def _check_checkpoint(opts: BatchOptions) -> None:
    """What can be told without touching the directory (``checkpoint.open_checkpoint`` opens
    it, and refuses what only opening finds)."""
    if not isinstance(opts.retry_failed, bool):
        raise BatchSpecError(f"retry_failed must be True or False, got {show(opts.retry_failed)}")
    where = opts.checkpoint_dir
    if where is None:
        return
    if not isinstance(where, str | os.PathLike) or not os.fspath(where):
        raise BatchSpecError("checkpoint_dir must be a directory path (str or Path) or None, "
                             f"got {show(where)}")
    if opts.redis_url:
        raise BatchSpecError(
            "checkpoint_dir is for the embedded engine; the distributed engine (redis_url=...) "
            "does not take it: its agents' state lives in Redis, so the batch survives the "
            "submitter's death by design (re-attach with get_batch(batch_id)); see "
            "docs/checkpoints.md")
    if os.path.exists(where) and not os.path.isdir(where):
        raise BatchSpecError(f"checkpoint_dir {os.fspath(where)!r} is a file, not a directory")


# --- inputs -------------------------------------------------------------------------------


# Deeper values cannot be stored: the state's JSON encoder (pydantic's limit) and Redis's
# Lua cjson both stop near a few hundred levels, with a raw error at submit or in a worker.
MAX_INPUT_DEPTH = 100


def _leaves(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    """(path, value) for every key string and non-container value, without recursion;
    a value nested deeper than ``MAX_INPUT_DEPTH`` is a ``BatchSpecError`` naming it."""
    stack = [(path, value, 1)]
    while stack:
        where, item, depth = stack.pop()
        if isinstance(item, Mapping | list | tuple) and depth > MAX_INPUT_DEPTH:
            raise BatchSpecError(
                f"key {path[:80]} is nested more than {MAX_INPUT_DEPTH} levels deep (at "
                f"{where[:80]}...), which cannot be stored as JSON; flatten it or pass it "
                "as a string")
        if isinstance(item, Mapping):
            for key, sub in item.items():
                yield f"a key of {where}", key
                stack.append((f"{where}[{key!r}]", sub, depth + 1))
        elif isinstance(item, list | tuple):
            stack.extend((f"{where}[{i}]", sub, depth + 1) for i, sub in enumerate(item))
        else:
            yield where, item


def _check_leaf(where: str, leaf: Any) -> None:
    if isinstance(leaf, str):
        check_text(where, leaf)
    elif leaf is not None and not isinstance(leaf, bool | int | float):
        try:
            to_json(leaf)
        except PydanticSerializationError as exc:
            raise BatchSpecError(
                f"{where} is of type {type(leaf).__name__}, which cannot be stored as JSON "
                f"({exc}); "
                "pass plain values (str, numbers, lists, dicts)") from None


def check_input(item: Any, index: int) -> dict[str, Any]:
    """One input as the plain dict an agent keeps in its state. The distributed engine stores
    it as JSON, so both engines refuse what JSON cannot hold."""
    if isinstance(item, BaseModel):
        item = item.model_dump(mode="json")
    if not isinstance(item, Mapping):
        raise BatchSpecError(f"each input must be a dict, got {type(item).__name__}",
                             index=index)
    data = dict(item)
    for key, value in data.items():
        if not isinstance(key, str):
            raise BatchSpecError(f"key {show(key)} ({type(key).__name__}) is not a string; "
                                 "input keys name the task's template variables", index=index)
        try:
            if not key.isascii():  # ASCII text has no surrogates: nothing to check
                check_text(f"key {key!r}", key)
            if isinstance(value, str):  # a flat value is its own one leaf: no walk
                if not value.isascii():
                    check_text(repr(key), value)
            elif value is not None and not isinstance(value, bool | int | float):
                for where, leaf in _leaves(value, repr(key)):
                    _check_leaf(where, leaf)
        except BatchSpecError as exc:
            raise BatchSpecError(str(exc), index=index) from None
    return data


def check_inputs(inputs: Any) -> list[dict[str, Any]]:
    """``inputs`` as one plain dict per agent."""
    if (inputs is None or isinstance(inputs, Mapping | str | bytes)
            or not isinstance(inputs, Iterable)):
        raise BatchSpecError(f"inputs must be a list of dicts, one per agent, got {show(inputs)}")
    return [check_input(item, i) for i, item in enumerate(inputs)]
