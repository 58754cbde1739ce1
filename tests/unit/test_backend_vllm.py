"""VLLMBackend's template calls and preflight over an in-process httpx transport (no sockets)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from agentbatch.backends.batch_prompting import text_conversations
from agentbatch.backends.registry import backend_from_url
from agentbatch.backends.vllm import VLLMBackend
from agentbatch.core.errors import BackendUnavailable, BatchSpecError
from agentbatch.core.plan import BatchPlan

Reply = Callable[[str, dict[str, Any]], httpx.Response]


def backend(reply: Reply, seen: list[tuple[str, dict[str, Any]]]) -> VLLMBackend:
    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.path, body))
        return reply(request.url.path, body)

    return VLLMBackend("vllm://gpu:8000", transport=httpx.MockTransport(handle))


def vllm_like(path: str, body: dict[str, Any]) -> httpx.Response:
    """Tokens are code points of ``[role]content`` per message, as a template would render."""
    if path == "/tokenize":
        text = "<s>" + "".join(f"[{m['role']}]{m['content']}" for m in body["messages"]) + ">"
        return httpx.Response(200, json={"tokens": [ord(c) for c in text], "count": len(text),
                                         "max_model_len": 4096})
    if path == "/detokenize":
        return httpx.Response(200, json={"prompt": "".join(map(chr, body["tokens"]))})
    return httpx.Response(404, json={"error": {"message": "Not Found"}})


def plan(batch_prompting: bool = True) -> BatchPlan:
    return BatchPlan(batch_id="b", total=1, model="m", backends=["vllm://gpu:8000"],
                     system_message="", batch_prompting=batch_prompting)


def test_vllm_urls_get_the_vllm_driver() -> None:
    assert type(backend_from_url("vllm://gpu:8000")) is VLLMBackend
    assert type(backend_from_url("sglang://gpu:8000")) is not VLLMBackend  # keeps ChatML


async def test_apply_template_is_tokenize_then_detokenize() -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    b = backend(vllm_like, seen)
    messages = [{"role": "user", "content": "hi"}]
    assert await b._apply_template(messages, model="m") == "<s>[user]hi>"
    assert [path for path, _ in seen] == ["/tokenize", "/detokenize"]
    assert seen[0][1] == {"model": "m", "messages": messages, "add_generation_prompt": True}
    assert seen[1][1] == {"model": "m", "tokens": [ord(c) for c in "<s>[user]hi>"]}


async def test_preflight_checks_only_with_batch_prompting() -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    await backend(vllm_like, seen).preflight(plan(batch_prompting=False))
    assert seen == []
    await backend(vllm_like, seen).preflight(plan())
    assert [path for path, _ in seen] == ["/tokenize", "/detokenize"]


@pytest.mark.parametrize(
    ("broken", "answer", "said"),
    [
        ("/tokenize", httpx.Response(404, json={"detail": "Not Found"}),
         "POST /tokenize answered HTTP 404"),
        ("/tokenize", httpx.Response(200, json={"count": 3}), "POST /tokenize answered no usable"),
        ("/tokenize", httpx.Response(200, json={"tokens": ["a"]}), "answered no token list"),
        ("/detokenize", httpx.Response(400, json={"error": {"message": "no"}}),
         "POST /detokenize answered HTTP 400"),
    ],
)
async def test_preflight_refuses_a_server_that_cannot_render(
        broken: str, answer: httpx.Response, said: str) -> None:
    def reply(path: str, body: dict[str, Any]) -> httpx.Response:
        return answer if path == broken else vllm_like(path, body)

    with pytest.raises(BatchSpecError) as info:
        await backend(reply, []).preflight(plan())
    assert said in str(info.value)
    assert "batch_prompting=True" in str(info.value) and "vllm://gpu:8000" in str(info.value)


async def test_preflight_lets_an_unreachable_server_say_so() -> None:
    def reply(path: str, body: dict[str, Any]) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    with pytest.raises(BackendUnavailable):
        await backend(reply, []).preflight(plan())


async def test_complete_batch_renders_each_shape_once_and_skips_the_second_bos() -> None:
    seen: list[tuple[str, dict[str, Any]]] = []

    def reply(path: str, body: dict[str, Any]) -> httpx.Response:
        if path != "/v1/completions":
            return vllm_like(path, body)
        return httpx.Response(200, json={"choices": [
            {"index": i, "text": f"t{i}", "finish_reason": "stop"}
            for i in range(len(body["prompt"]))]})

    b = backend(reply, seen)
    convs = [[{"role": "user", "content": [{"type": "text", "text": f"q{i}"}]}] for i in range(5)]
    results = await b.complete_batch(["ignored"] * 5, model="m", messages=convs,
                                     json_schema={"name": "A", "schema": {"type": "object"}})
    assert [getattr(r, "text", r) for r in results] == [f"t{i}" for i in range(5)]
    paths = [path for path, _ in seen]
    assert paths.count("/tokenize") == 2 and paths[-1] == "/v1/completions"
    sent = seen[-1][1]
    assert sent["prompt"] == [f"<s>[user]q{i}>" for i in range(5)]
    assert sent["add_special_tokens"] is False
    assert sent["response_format"]["json_schema"]["name"] == "A"


def test_text_conversations_keeps_role_and_text_only() -> None:
    convs = [[{"role": "system", "content": None, "name": "x"},
              {"role": "user", "content": [{"type": "text", "text": "a"}, "b"]},
              {"content": "c"}]]
    assert text_conversations(convs) == [[{"role": "system", "content": ""},
                                          {"role": "user", "content": "ab"},
                                          {"role": "user", "content": "c"}]]
