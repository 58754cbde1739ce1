"""Second hardening pass (issue 21): bad input is refused with an error naming what is wrong."""

from __future__ import annotations

import ipaddress
import json

import pytest
import redis

from agentbatch.core.errors import BatchSpecError
from agentbatch.core.import_allowlist import check_import_path, owns_path
from agentbatch.core.model_io import canonical_json
from agentbatch.core.options import BatchOptions
from agentbatch.core.output import OutputContract
from agentbatch.toolpool.builtins import read_file
from agentbatch.toolpool.public_http import address_refusal, http_allowlist
from agentbatch.turnloop.compile import compile_batch
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


SIM = "sim://127.0.0.1:9"  # never contacted


def _system(**kw) -> str:
    opts = BatchOptions(task="Say {x}.", inputs=[{"x": 1}], model="m", backend=SIM,
                        output_schema=Answer, **kw)
    return compile_batch(opts).plan.system_message


@pytest.mark.parametrize("given", [
    "",
    OutputContract(Answer).instructions(),
    "Answer in this schema: " + json.dumps(Answer.model_json_schema(), indent=2),
    "Schema:\n" + canonical_json(Answer.model_json_schema()) + "\nBe brief.",
])
@pytest.mark.parametrize("mode", ["native", "json"])
def test_the_output_schema_is_in_the_system_message_once(given: str, mode: str) -> None:
    kw = {"tools": [lookup], "tool_calling": "json"} if mode == "json" else {}
    system = _system(system_prompt=given or None, **kw)
    # each field name appears once per copy of the schema ("score" in properties + required)
    per_copy = canonical_json(Answer.model_json_schema()).count('"score"')
    assert system.count('"score"') == per_copy, system
    if given:
        assert system.startswith(given)


@pytest.mark.parametrize("address", [
    "::7f00:1", "::a00:1", "::a9fe:a9fe", "::ffff:0:a00:1", "::ffff:0:7f00:1",
    "64:ff9b:1::a00:1", "64:ff9b:1::808:808", "64:ff9b:1:0:a00:1::", "fec0::1",
    "fec0:0:0:1::1", "192.0.0.8", "192.0.0.1", "100::1", "2001:db8::1", "3fff::1",
])  # fmt: skip
def test_every_non_global_address_is_refused(address: str) -> None:
    refusal = address_refusal("example.com", ipaddress.ip_address(address), http_allowlist(""))
    assert refusal is not None
    assert "not a public address" in refusal or "metadata" in refusal, refusal


@pytest.mark.parametrize("address", ["8.8.8.8", "2001:4860:4860::8888", "2a00:1450::1"])
def test_global_unicast_still_passes(address: str) -> None:
    assert address_refusal("example.com", ipaddress.ip_address(address),
                           http_allowlist("")) is None


BAD_BATCH_IDS = [
    ("newline", "run\n1"), ("NUL", "run\x001"), ("brace", "run}1"), ("star", "run*"),
    ("space", "run 1"), ("slash", "a/b"), ("100 KB", "x" * 100_000), ("129 chars", "x" * 129),
    ("empty", ""),
]


@pytest.mark.redis
@pytest.mark.parametrize("engine", ["embedded", "distributed"])
@pytest.mark.parametrize("bad", [b for _, b in BAD_BATCH_IDS],
                         ids=[name for name, _ in BAD_BATCH_IDS])
def test_batch_id_is_a_short_safe_name(bad: str, engine: str, request) -> None:
    from agentbatch import run_batch, submit_batch

    kw: dict = {"model": "m", "backend": SIM, "batch_id": bad}
    if engine == "distributed":
        url = request.getfixturevalue("redis_url")
        with pytest.raises(BatchSpecError, match="batch_id") as exc:
            submit_batch("Say {x}.", [{"x": 1}], redis_url=url, **kw)
        assert redis.from_url(url).dbsize() == 0  # nothing written or enqueued
    else:
        with pytest.raises(BatchSpecError, match="batch_id") as exc:
            run_batch("Say {x}.", [{"x": 1}], **kw)
    assert "A-Z" in str(exc.value) and len(str(exc.value)) < 400


@pytest.mark.parametrize("good", ["b1", "run-2024.06.01:part_3", "x" * 128])
def test_a_safe_batch_id_is_kept(good: str) -> None:
    opts = BatchOptions(task="Say {x}.", inputs=[{"x": 1}], model="m", backend=SIM,
                        batch_id=good)
    assert compile_batch(opts).plan.batch_id == good


@pytest.mark.parametrize("task", [
    "{x.__class__.__mro__}", "{x.real}", "{x[0]}", "{x:>99999999}", "{x:{x}}",
    "{x!a:>10000}", "{x:,>500}",
])
def test_a_task_template_has_plain_fields_only(task: str) -> None:
    opts = BatchOptions(task=task, inputs=[{"x": 1}], model="m", backend=SIM)
    with pytest.raises(BatchSpecError, match="task") as exc:
        compile_batch(opts)
    assert "{x}" in str(exc.value)


@pytest.mark.parametrize("task,expected", [
    ("Say {x}.", "Say 7."), ("Say {x!r}.", "Say '7'."), ("{{literal}} {x}", "{literal} 7"),
    ("{x:>5}", "    7"), ("{x:.2}", "7"),
])
def test_plain_fields_conversions_and_small_formats_still_render(task: str, expected: str
                                                                   ) -> None:
    opts = BatchOptions(task=task, inputs=[{"x": "7"}], model="m", backend=SIM)
    (state,) = compile_batch(opts).states
    assert state.messages[0]["content"] == expected


def _deep(levels: int, leaf: object = 1) -> object:
    value = leaf
    for _ in range(levels):
        value = [value] if len(str(_)) % 2 else {"k": value}
    return value


@pytest.mark.redis
@pytest.mark.parametrize("engine", ["embedded", "distributed"])
def test_a_deeply_nested_input_is_refused_naming_it(engine: str, request) -> None:
    from agentbatch import run_batch, submit_batch

    inputs = [{"x": 0}, {"x": 1, "tree": _deep(100_000)}]
    kw: dict = {"model": "sim-model", "backend": request.getfixturevalue("sim_url")}
    if engine == "distributed":
        url = request.getfixturevalue("redis_url")
        with pytest.raises(BatchSpecError) as exc:
            submit_batch("Say {x}.", inputs, redis_url=url, **kw)
        assert redis.from_url(url).dbsize() == 0
    else:
        with pytest.raises(BatchSpecError) as exc:
            run_batch("Say {x}.", inputs, **kw)
    message = str(exc.value)
    assert message.startswith("input 1: ") and "'tree'" in message and "deep" in message, \
        message[:500]
    assert len(message) < 600


def test_nesting_up_to_the_limit_is_kept() -> None:
    from agentbatch.turnloop.validate import MAX_INPUT_DEPTH

    opts = BatchOptions(task="Say {x}.", inputs=[{"x": 1, "tree": _deep(MAX_INPUT_DEPTH - 1)}],
                        model="m", backend=SIM)
    assert len(compile_batch(opts).states) == 1
