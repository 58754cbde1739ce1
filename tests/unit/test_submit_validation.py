"""Every public parameter is checked at submit: a BatchSpecError naming it, nothing enqueued."""

from __future__ import annotations

import asyncio
import inspect
import math

import pytest
import redis
from pydantic import BaseModel

from agentbatch import (
    BatchSpecError,
    arun_batch,
    asubmit_batch,
    run_batch,
    submit_batch,
)
from agentbatch.core.errors import UnknownParameter
from agentbatch.distributed.handle import DistributedHandle

BASE = {"model": "sim-model", "backend": "sim://127.0.0.1:9"}  # never contacted
TASK = "Say {x}."
INPUTS = [{"x": 1}]

# (id, task, inputs, keyword overrides, words the message must contain)
CASES = [
    ("inputs None", TASK, None, {}, ["inputs"]),
    ("inputs str", TASK, "abc", {}, ["inputs"]),
    ("backend int", TASK, INPUTS, {"backend": 8000}, ["backend", "8000"]),
    ("backend list of int", TASK, INPUTS, {"backend": [8000]}, ["backend"]),
    ("tools int", TASK, INPUTS, {"tools": 5}, ["tools", "5"]),
    ("system_prompt int", TASK, INPUTS, {"system_prompt": 5}, ["system_prompt"]),
    ("redis_url int", TASK, INPUTS, {"redis_url": 5}, ["redis_url"]),
    ("redis_url not redis", TASK, INPUTS, {"redis_url": "garbage"}, ["redis_url"]),
    ("model int", TASK, INPUTS, {"model": 5}, ["model"]),
    ("temperature str", TASK, INPUTS, {"temperature": "hot"}, ["temperature", "'hot'"]),
    ("temperature nan", TASK, INPUTS, {"temperature": math.nan}, ["temperature", "nan"]),
    ("temperature negative", TASK, INPUTS, {"temperature": -0.5}, ["temperature"]),
    ("max_tokens negative", TASK, INPUTS, {"max_tokens": -1}, ["max_tokens"]),
    ("max_tokens zero", TASK, INPUTS, {"max_tokens": 0}, ["max_tokens"]),
    ("max_turns bool", TASK, INPUTS, {"max_turns": True}, ["max_turns"]),
    ("timeout_per_turn inf", TASK, INPUTS, {"timeout_per_turn": math.inf},
     ["timeout_per_turn", "inf"]),
    ("timeout_per_turn nan", TASK, INPUTS, {"timeout_per_turn": math.nan},
     ["timeout_per_turn"]),
    ("timeout_per_tool inf", TASK, INPUTS, {"timeout_per_tool": math.inf},
     ["timeout_per_tool"]),
    ("max_server_waiting negative", TASK, INPUTS, {"max_server_waiting": -1},
     ["max_server_waiting"]),
    ("max_tool_calls_per_turn zero", TASK, INPUTS, {"max_tool_calls_per_turn": 0},
     ["max_tool_calls_per_turn", ">= 1"]),
    ("warm_prefix str", TASK, INPUTS, {"warm_prefix": "yes"}, ["warm_prefix"]),
    ("on_result int", TASK, INPUTS, {"on_result": 5}, ["on_result"]),
    ("batch_id int", TASK, INPUTS, {"batch_id": 5}, ["batch_id"]),
    ("output_schema dict", TASK, INPUTS, {"output_schema": dict}, ["output_schema"]),
    ("lone surrogate in task", "Say {x}\ud800", INPUTS, {}, ["task", "surrogate"]),
    ("lone surrogate in input", TASK, [{"x": "fine"}, {"x": "bad\udc80"}], {},
     ["input 1", "'x'", "surrogate"]),
    ("lone surrogate nested", TASK, [{"x": {"deep": ["ok", "\udc80"]}}], {},
     ["input 0", "'x'", "surrogate"]),
    ("non-string key", TASK, [{"x": 1}, {"x": 2, 5: "five"}], {}, ["input 1", "key 5"]),
    ("unserialisable value", TASK, [{"x": 1}, {"x": object()}], {},
     ["input 1", "'x'", "JSON"]),
    ("lambda tool", TASK, INPUTS, {"tools": [lambda key: key]},
     ["tools[0]", "@tool", "module level"]),
]


def _kwargs(overrides: dict, engine: str, request: pytest.FixtureRequest) -> dict:
    kwargs = {**BASE, **overrides}
    if engine == "distributed" and "redis_url" not in overrides:
        kwargs["redis_url"] = request.getfixturevalue("redis_url")
    return kwargs


@pytest.mark.parametrize("engine", ["embedded", "distributed"])
@pytest.mark.parametrize(("task", "inputs", "overrides", "words"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_value_is_refused_before_anything_is_enqueued(task, inputs, overrides, words,
                                                          engine, request):
    kwargs = _kwargs(overrides, engine, request)
    with pytest.raises(BatchSpecError) as info:
        submit_batch(task, inputs, **kwargs)
    for word in words:
        assert word in str(info.value)
    if isinstance(kwargs.get("redis_url"), str) and kwargs["redis_url"].startswith("redis"):
        assert redis.from_url(kwargs["redis_url"]).dbsize() == 0


@pytest.mark.parametrize("fn", [submit_batch, run_batch])
def test_unknown_keyword_names_it_and_the_close_match(fn):
    with pytest.raises(UnknownParameter) as info:
        fn(TASK, INPUTS, max_turn=3, **BASE)
    assert isinstance(info.value, TypeError) and isinstance(info.value, BatchSpecError)
    assert "max_turn" in str(info.value) and "did you mean 'max_turns'" in str(info.value)
    assert fn.__name__ in str(info.value)


@pytest.mark.parametrize("fn", [asubmit_batch, arun_batch])
def test_async_forms_check_the_same_way(fn):
    with pytest.raises(UnknownParameter):
        asyncio.run(fn(TASK, INPUTS, max_turn=3, **BASE))
    with pytest.raises(BatchSpecError, match="temperature"):
        asyncio.run(fn(TASK, INPUTS, temperature="hot", **BASE))


def test_the_four_functions_share_one_documented_signature():
    fns = [submit_batch, asubmit_batch, run_batch, arun_batch]
    params = [list(inspect.signature(fn).parameters) for fn in fns]
    assert all(p == params[0] for p in params)
    assert "max_tool_calls_per_turn" in params[0] and "kwargs" not in params[0]
    assert inspect.iscoroutinefunction(asubmit_batch) and inspect.iscoroutinefunction(arun_batch)
    for fn in fns:
        for name in params[0]:
            assert f"    {name}:" in (fn.__doc__ or ""), (fn.__name__, name)


class Plain(BaseModel):
    x: int


def test_pydantic_inputs_and_defaults_still_pass_validation():
    from agentbatch.core.options import BatchOptions
    from agentbatch.turnloop.compile import compile_batch

    compiled = compile_batch(BatchOptions(task=TASK, inputs=[Plain(x=3), {"x": [1.5, None]}],
                                          model="m", backend="sim://127.0.0.1:8000"))
    assert [s.input for s in compiled.states] == [{"x": 3}, {"x": [1.5, None]}]
    assert compiled.plan.max_tool_calls_per_turn == 32


@pytest.mark.redis
def test_results_after_garbage_names_the_argument(redis_url):
    handle = DistributedHandle("no-such-batch", redis_url, total=0)
    try:
        with pytest.raises(BatchSpecError, match="after"):
            next(handle.results(after="garbage"))

        async def first() -> None:
            await handle.aresults(after="garbage").__anext__()

        with pytest.raises(BatchSpecError, match="after"):
            asyncio.run(first())
    finally:
        handle.close()


@pytest.mark.parametrize("url", [
    "redis://:s3cr#et@127.0.0.1:6379/0",       # '#' starts a fragment
    "redis://:s3cr/et@127.0.0.1:6379/0",       # '/' ends the authority early
    "redis://user:s3cr?et@127.0.0.1:6379/0",   # '?' starts the query
    "redis://:s3cr:et@127.0.0.1:notaport/0",   # a bad port after the password
])
def test_redis_password_with_reserved_characters_is_masked(url):
    with pytest.raises(BatchSpecError) as info:
        submit_batch(TASK, INPUTS, **{**BASE, "redis_url": url})
    message = str(info.value)
    assert "redis_url" in message and "percent-encoded" in message
    assert "s3cr" not in message and "et@" not in message


@pytest.mark.redis
@pytest.mark.parametrize("backend", [
    "vllm://127.0.0.1:9?api_key=sk-secret-value",
    "openai://127.0.0.1:9?model=m&token=sk-secret-value",
    ["sim://127.0.0.1:9", "sim://127.0.0.1:8?key=sk-secret-value"],
])
def test_backend_url_with_an_unknown_query_parameter_never_reaches_redis(backend, redis_url):
    with pytest.raises(BatchSpecError) as info:
        submit_batch(TASK, INPUTS, **{**BASE, "backend": backend, "redis_url": redis_url})
    message = str(info.value)
    assert "unknown query parameter" in message and "sk-secret-value" not in message
    client = redis.from_url(redis_url)
    assert client.dbsize() == 0  # no plan stored, so no key in Redis
