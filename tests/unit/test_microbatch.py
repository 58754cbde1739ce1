"""MicroBatchingBackend over a fake inner backend that counts its calls.

Flushes are driven by ``max_batch`` (with a window far longer than any test) wherever the
grouping matters, so nothing depends on how fast this machine runs the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agentbatch.backends.base import BackendCapabilities, ServerLoad
from agentbatch.backends.microbatch import MicroBatchingBackend, batchable, chatml, group_key
from agentbatch.core.errors import BackendTimeout, RateLimited, ServerError
from agentbatch.core.model_io import ModelRequest, ModelResponse
from tests.support.fake_backend import Outcome, ScriptedBackend

LONG = 60.0  # a window no test waits for: flushes come from max_batch or aclose


class FakeInner(ScriptedBackend):
    """Answers ``complete`` with ``chat:<last user text>`` and each batched prompt with
    ``batch:<prompt>``; ``fail_prompt`` marks prompts whose slot gets a ``RateLimited``."""

    def __init__(self, *, batch_prompting: bool = True) -> None:
        super().__init__(name="fake://inner", load=ServerLoad(running=1, waiting=2),
                         capabilities=BackendCapabilities(batch_prompting=batch_prompting))
        self.complete_calls = self.requests
        self.batch_calls: list[dict[str, Any]] = []
        self.fail_prompt = "FAIL"
        self.raise_in_batch: BaseException | None = None

    def outcome(self, request: ModelRequest) -> Outcome:
        return "chat:" + request.messages[-1]["content"]

    async def complete_batch(self, prompts: list[str], **kwargs: Any) -> list[Any]:
        self.batch_calls.append({"prompts": list(prompts), **kwargs})
        if self.hold is not None:
            await self.hold.wait()
        if self.raise_in_batch is not None:
            raise self.raise_in_batch
        return [
            RateLimited("slow down", status=429) if self.fail_prompt in p
            else ModelResponse(text="batch:" + p)
            for p in prompts
        ]


def req(text: str, **kw: Any) -> ModelRequest:
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": text}]
    return ModelRequest(model=kw.pop("model", "m"), messages=messages, **kw)


def prompt_of(text: str) -> str:
    return chatml(req(text).messages)


async def test_concurrent_calls_become_one_batch_each_caller_gets_its_own_answer() -> None:
    inner = FakeInner()
    mb = MicroBatchingBackend(inner, window_s=LONG, max_batch=10)
    texts = [f"q{i}" for i in range(10)]
    responses = await asyncio.gather(*(mb.complete(req(t, max_tokens=7)) for t in texts))
    assert len(inner.batch_calls) == 1 and inner.complete_calls == []
    call = inner.batch_calls[0]
    assert call["prompts"] == [prompt_of(t) for t in texts]
    assert (call["model"], call["max_tokens"], call["temperature"], call["json_schema"]) == (
        "m", 7, None, None)
    assert [r.text for r in responses] == ["batch:" + prompt_of(t) for t in texts]
    assert mb.stats() == {"prompts": 10, "batches": 1, "batched_prompts": 10, "solo": 0,
                          "direct": 0, "inner_calls": 1, "requests_sent": 1}


async def test_a_failed_slot_raises_for_its_caller_only() -> None:
    inner = FakeInner()
    mb = MicroBatchingBackend(inner, window_s=LONG, max_batch=4)
    results = await asyncio.gather(
        *(mb.complete(req(t)) for t in ["a", "FAIL", "c", "d"]), return_exceptions=True
    )
    assert isinstance(results[1], RateLimited)
    assert [r.text for i, r in enumerate(results) if i != 1] == [  # type: ignore[union-attr]
        "batch:" + prompt_of(t) for t in ["a", "c", "d"]
    ]


async def test_an_unexpected_batch_exception_reaches_every_caller() -> None:
    inner = FakeInner()
    inner.raise_in_batch = RuntimeError("bug")
    mb = MicroBatchingBackend(inner, window_s=LONG, max_batch=3)
    results = await asyncio.gather(*(mb.complete(req(t)) for t in "abc"), return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in results)


async def test_groups_split_by_schema_and_sampling_settings() -> None:
    inner = FakeInner()
    mb = MicroBatchingBackend(inner, window_s=LONG, max_batch=2)
    schema_a = {"name": "A", "schema": {"type": "object"}}
    schema_b = {"name": "B", "schema": {"type": "object"}}
    reqs = [
        req("a1", json_schema=schema_a), req("b1", json_schema=schema_b),
        req("a2", json_schema=schema_a), req("b2", json_schema=schema_b),
        req("t1", temperature=0.5), req("t2", temperature=0.5),
    ]
    await asyncio.gather(*(mb.complete(r) for r in reqs))
    seen = sorted((c["json_schema"] or {}).get("name", f"temp={c['temperature']}")
                  for c in inner.batch_calls)
    assert seen == ["A", "B", "temp=0.5"]
    for call in inner.batch_calls:
        assert len(call["prompts"]) == 2
    assert group_key(reqs[0]) == group_key(reqs[2]) != group_key(reqs[1])


async def test_requests_with_tools_go_straight_to_the_inner_backend() -> None:
    inner = FakeInner()
    mb = MicroBatchingBackend(inner, window_s=LONG, max_batch=2)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    response = await mb.complete(req("x", tools=[tool]))
    assert response.text == "chat:x"
    assert len(inner.complete_calls) == 1 and inner.batch_calls == []
    assert mb.stats()["direct"] == 1


async def test_a_lone_request_is_sent_as_a_chat_call_when_its_window_closes() -> None:
    inner = FakeInner()
    mb = MicroBatchingBackend(inner, window_s=0.001, max_batch=32)
    response = await mb.complete(req("alone"))
    assert response.text == "chat:alone"
    assert inner.batch_calls == [] and len(inner.complete_calls) == 1
    assert (mb.solo, mb.batches) == (1, 0)


async def test_cancelled_callers_are_left_out_of_the_batch() -> None:
    inner = FakeInner()
    mb = MicroBatchingBackend(inner, window_s=LONG, max_batch=3)
    gone = asyncio.ensure_future(mb.complete(req("gone")))
    kept = asyncio.ensure_future(mb.complete(req("kept")))
    await asyncio.sleep(0)  # both queued
    gone.cancel()
    await asyncio.sleep(0)
    last = await mb.complete(req("last"))  # third item: the window flushes by size
    assert (await kept).text == "batch:" + prompt_of("kept")
    assert last.text == "batch:" + prompt_of("last")
    assert inner.batch_calls[0]["prompts"] == [prompt_of("kept"), prompt_of("last")]
    assert gone.cancelled()


async def test_a_caller_timeout_is_a_backend_timeout() -> None:
    inner = FakeInner()
    inner.hold = asyncio.Event()  # the batch never answers until released
    mb = MicroBatchingBackend(inner, window_s=LONG, max_batch=2)
    waiting = asyncio.ensure_future(mb.complete(req("patient")))
    with pytest.raises(BackendTimeout):
        await mb.complete(req("hasty", timeout_s=0.01))
    inner.hold.set()
    assert (await waiting).text == "batch:" + prompt_of("patient")


async def test_aclose_flushes_what_is_queued_then_closes_the_inner() -> None:
    inner = FakeInner()
    mb = MicroBatchingBackend(inner, window_s=LONG, max_batch=32)
    pending = [asyncio.ensure_future(mb.complete(req(t))) for t in ("p", "q")]
    await asyncio.sleep(0)
    await mb.aclose()
    assert [(await p).text for p in pending] == ["batch:" + prompt_of(t) for t in ("p", "q")]
    assert inner.closed


async def test_passes_through_when_the_inner_cannot_batch() -> None:
    inner = FakeInner(batch_prompting=False)
    mb = MicroBatchingBackend(inner, window_s=LONG, max_batch=2)
    assert mb.enabled is False
    out = await asyncio.gather(mb.complete(req("a")), mb.complete(req("b")))
    assert [r.text for r in out] == ["chat:a", "chat:b"]
    assert inner.batch_calls == []


async def test_other_attributes_are_the_inner_backends() -> None:
    inner = FakeInner()
    mb = MicroBatchingBackend(inner)
    assert mb.name == "fake://inner" and mb.capabilities is inner.capabilities
    await mb.warm(req("w"))
    assert inner.warmed and (await mb.fetch_load()) == ServerLoad(running=1, waiting=2)


async def test_a_failing_inner_complete_for_a_lone_request_is_raised() -> None:
    inner = FakeInner()

    async def boom(request: ModelRequest) -> ModelResponse:
        raise ServerError("down", status=503)

    inner.complete = boom  # type: ignore[method-assign]
    mb = MicroBatchingBackend(inner, window_s=0.001)
    with pytest.raises(ServerError):
        await mb.complete(req("x"))


def test_chatml_template() -> None:
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text",
                                                                    "text": "there"}]},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "again"},
    ]
    assert chatml(messages) == (
        "<|im_start|>system\nbe brief<|im_end|>\n"
        "<|im_start|>user\nhi there<|im_end|>\n"
        "<|im_start|>assistant\nhello<|im_end|>\n"
        "<|im_start|>user\nagain<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    ("messages", "tools", "ok"),
    [
        ([{"role": "user", "content": "x"}], [], True),
        ([{"role": "system", "content": "s"}, {"role": "user", "content": "x"}], [], True),
        ([{"role": "user", "content": "x"}], [{"type": "function"}], False),
        ([{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}], [], False),
        ([{"role": "tool", "tool_call_id": "1", "content": "r"}], [], False),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], [], False),
        ([], [], False),
    ],
)
def test_batchable(messages: list[dict[str, Any]], tools: list[Any], ok: bool) -> None:
    assert batchable(ModelRequest(model="m", messages=messages, tools=tools)) is ok


def test_rejects_bad_settings() -> None:
    with pytest.raises(ValueError):
        MicroBatchingBackend(FakeInner(), max_batch=0)
    with pytest.raises(ValueError):
        MicroBatchingBackend(FakeInner(), window_s=-1)
