"""Second hardening pass (issue 21): bad input is refused with an error naming what is wrong."""

from __future__ import annotations

import pytest

from agentbatch.errors import BatchSpecError
from agentbatch.orchestrator.import_allowlist import check_import_path, owns_path
from agentbatch.toolpool.builtins import read_file
from tests.support.tools import Answer, lookup

ALLOW = ("tests.support",)


@pytest.mark.parametrize("path", [
    "tests.support.tools:lookup.__class__.read_file",
    "tests.support.tools:lookup.read_file",
    "tests.support.tools:__builtins__",
    "tests.support.tools:Answer.__mro__",
])
def test_an_import_path_is_one_name_without_dunders(path: str) -> None:
    with pytest.raises(BatchSpecError, match="no attribute chains or dunder names") as exc:
        check_import_path(path, ALLOW, "tool 'lookup':")
    assert repr(path) in str(exc.value)


def test_a_schema_may_be_a_nested_class_but_not_a_dunder() -> None:
    check_import_path("tests.support.tools:Outer.Inner", ALLOW, "output schema", nested=True)
    check_import_path("tests.support.tools:lookup", ALLOW, "tool 'lookup':")
    with pytest.raises(BatchSpecError, match="dunder"):
        check_import_path("tests.support.tools:Answer.__base__", ALLOW, "output schema",
                          nested=True)


def test_a_loaded_object_must_name_itself_by_the_requested_path() -> None:
    assert owns_path(lookup, "tests.support.tools:lookup")
    assert owns_path(Answer, "tests.support.tools:Answer")
    # a re-export of a tool defined outside the allowlist is not that module's tool
    assert not owns_path(read_file, "tests.support.tools:read_file")
    assert not owns_path(Answer, "tests.support.other:Answer")
