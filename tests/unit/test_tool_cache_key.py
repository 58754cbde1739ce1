"""``@tool(cache_key=fn)``: calls share a cached result and an execution by the key the function
gives (e.g. a normalised path), not by their exact arguments; the key function is part of the
tool's identity, and a bad one is refused (or its failure reported) naming ``cache_key``."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

from agentbatch.core.errors import BatchSpecError
from agentbatch.core.model_io import ToolCall
from agentbatch.toolpool import ToolContext, ToolPool, tool

RUNS: list[str] = []


def normalised(path: str) -> str:
    return os.path.normpath(path)


@tool(cacheable=True, cache_key=normalised)
def read_doc(path: str) -> str:
    """Read a document.

    Args:
        path: its path.
    """
    RUNS.append(path)
    return f"contents of {os.path.normpath(path)}"


@tool(cacheable=True)
def read_doc_plain(path: str) -> str:
    """The same tool without a cache key.

    Args:
        path: its path.
    """
    RUNS.append(path)
    return f"contents of {os.path.normpath(path)}"


def broken_key(path: str) -> str:
    raise KeyError(path)


@tool(coalesce=True, cache_key=broken_key)
def read_doc_broken(path: str) -> str:
    """A tool whose key function raises.

    Args:
        path: its path.
    """
    RUNS.append(path)
    return "never"


def ctx(i: int) -> ToolContext:
    return ToolContext.for_call("batch-1", i, 0, f"call-{i}")


def run(pool: ToolPool, name: str, paths: list[str]) -> list[Any]:
    async def go() -> list[Any]:
        return [await pool.run(ToolCall(id=f"call-{i}", name=name, arguments={"path": p}),
                               ctx(i)) for i, p in enumerate(paths)]
    return asyncio.run(go())


PATHS = ["docs/a.md", "docs/./a.md", "docs/x/../a.md"]


def test_calls_with_the_same_key_share_one_execution() -> None:
    RUNS.clear()
    outcomes = run(ToolPool([read_doc]), "read_doc", PATHS)
    assert RUNS == ["docs/a.md"]  # before: each spelling of the path ran
    assert [o.cached for o in outcomes] == [False, True, True]
    assert {o.content for o in outcomes} == {"contents of docs/a.md"}


def test_without_a_key_each_spelling_runs() -> None:
    RUNS.clear()
    run(ToolPool([read_doc_plain]), "read_doc_plain", PATHS)
    assert RUNS == PATHS


def test_the_key_function_is_part_of_the_identity() -> None:
    other = tool(cacheable=True, cache_key=lambda path: path.lower())(read_doc.fn)
    plain = tool(cacheable=True)(read_doc.fn)
    assert len({read_doc.identity, other.identity, plain.identity}) == 3


def test_a_key_function_that_raises_fails_the_call_as_data_naming_cache_key() -> None:
    RUNS.clear()
    [outcome] = run(ToolPool([read_doc_broken]), "read_doc_broken", ["a"])
    assert not outcome.ok and "cache_key raised KeyError" in outcome.content
    assert RUNS == []


@pytest.mark.parametrize(("options", "message"), [
    ({"cacheable": True, "cache_key": "path"}, "cache_key must be a callable"),
    ({"cache_key": normalised}, "cache_key needs cacheable=True or coalesce=True"),
    ({"coalesce": True, "cache_key": lambda other: other},
     "cache_key must accept the tool's arguments (path)"),
])
def test_a_bad_cache_key_is_refused_at_decoration(options: dict, message: str) -> None:
    with pytest.raises(BatchSpecError) as caught:
        tool(**options)(read_doc.fn)
    assert message in str(caught.value)
