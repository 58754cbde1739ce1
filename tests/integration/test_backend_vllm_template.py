"""Batch prompting on ``vllm://`` renders prompts with the server's own chat template (vLLM's
``/tokenize`` + ``/detokenize``), over real HTTP against the simulator, whose template is not
ChatML; and a ``vllm://`` server without ``/tokenize`` is refused before any completion."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from agentbatch import run_batch, submit_batch
from agentbatch.backends.microbatch import chatml
from agentbatch.backends.vllm import VLLMBackend
from agentbatch.core.errors import BatchSpecError
from agentbatch.core.model_io import ModelResponse
from agentbatch.sim.server import SimServer
from agentbatch.sim.tokens import TEMPLATE_GENERATION, render_template
from tests.support.recording_http import RecordingServer

N = 12


class Answer(BaseModel):
    answer: str


def vllm_url(sim: SimServer) -> str:
    return "vllm://" + sim.url.split("://", 1)[1]


def sim_stats(sim: SimServer) -> dict[str, Any]:
    """``/sim/stats`` over HTTP, as any client would read it."""
    return httpx.get(sim.url + "/sim/stats", timeout=10).json()


def test_batched_prompts_use_the_servers_template_and_keep_the_schema(sim: SimServer) -> None:
    results = run_batch("Question {i}.\n@sim answer {{\"answer\": \"a{i}\"}}",
                        [{"i": i} for i in range(N)], model="m", backend=vllm_url(sim),
                        output_schema=Answer, batch_prompting=True, warm_prefix=False)
    assert [r.output.answer if r.ok else r.error for r in results] == [f"a{i}" for i in range(N)]
    stats = sim_stats(sim)
    batched = [b for b in stats["recent_completions"] if isinstance(b["prompt"], list)]
    assert batched, f"no batched /v1/completions request: {stats['requests']}"
    assert sum(stats["requests"].values()) < N
    for body in batched:
        assert body["add_special_tokens"] is False  # the template's text holds the BOS
        assert body["response_format"]["type"] == "json_schema"
        assert body["response_format"]["json_schema"]["schema"]["required"] == ["answer"]
        for prompt in body["prompt"]:
            assert prompt.startswith("<|sim:system|>\n") and prompt.endswith(TEMPLATE_GENERATION)
            assert "<|im_start|>" not in prompt and "\n<|sim:user|>\nQuestion " in prompt
    # One preflight probe, then the (system, user) shape learned once: placeholders + check.
    assert stats["template_requests"] == {"tokenize": 3, "detokenize": 3}


async def test_template_calls_once_per_shape_and_prompts_match_the_server(
        sim: SimServer) -> None:
    convs: list[list[dict[str, Any]]] = []
    for i in range(10):
        user = {"role": "user", "content": f"Item {i}: {{braces}} and spaces  \n@sim answer x{i}"}
        convs.append([user] if i % 2 else [{"role": "system", "content": "Be brief."}, user])
    backend = VLLMBackend(vllm_url(sim))
    try:
        results = await backend.complete_batch([chatml(c) for c in convs], model="m",
                                               messages=convs, request_id="b1")
    finally:
        await backend.aclose()
    assert [r.text if isinstance(r, ModelResponse) else r for r in results] == [
        f"x{i}" for i in range(10)]
    stats = sim_stats(sim)
    assert stats["requests"] == {"completions": 1}
    assert stats["recent_completions"][-1]["prompt"] == [render_template(c) for c in convs]
    assert stats["template_requests"] == {"tokenize": 4, "detokenize": 4}  # 2 shapes x 2


async def test_prompts_rendered_by_the_caller_are_sent_as_they_are(sim: SimServer) -> None:
    backend = VLLMBackend(vllm_url(sim))
    try:
        results = await backend.complete_batch(["@sim answer p", "@sim answer q"], model="m")
    finally:
        await backend.aclose()
    assert [r.text if isinstance(r, ModelResponse) else r for r in results] == ["p", "q"]
    stats = sim_stats(sim)
    assert stats["recent_completions"][-1]["prompt"] == ["@sim answer p", "@sim answer q"]
    assert "add_special_tokens" not in stats["recent_completions"][-1]  # the server adds BOS
    assert stats["template_requests"] == {}


@pytest.mark.parametrize("entry", [submit_batch, run_batch], ids=["submit", "run"])
def test_a_server_without_tokenize_is_refused_before_any_completion(entry: Any) -> None:
    server = RecordingServer().start()  # answers 404 on every path but chat
    try:
        with pytest.raises(BatchSpecError) as info:
            entry("Question {i}.", [{"i": i} for i in range(4)], model="m",
                  backend=f"vllm://{server.netloc}", batch_prompting=True)
    finally:
        server.stop()
    message = str(info.value)
    assert "batch_prompting" in message and server.netloc in message
    assert "/tokenize answered HTTP 404" in message
    assert [(r.method, r.path) for r in server.requests] == [("POST", "/tokenize")]


def test_sim_serves_tokenize_and_detokenize(sim: SimServer) -> None:
    conv = [{"role": "user", "content": "Hi ✓"}]
    with httpx.Client(base_url=sim.url, timeout=10) as client:
        got = client.post("/tokenize", json={"model": "m", "messages": conv,
                                             "add_generation_prompt": True}).json()
        assert got["count"] == len(got["tokens"]) and got["max_model_len"] > 0
        back = client.post("/detokenize", json={"model": "m", "tokens": got["tokens"]})
        assert back.json() == {"prompt": render_template(conv)}
        assert client.post("/tokenize", json={"prompt": "ab"}).json()["tokens"] == [97, 98]
        assert client.post("/detokenize", json={"tokens": [-1]}).status_code == 400
        assert client.post("/tokenize", json={"model": "m"}).status_code == 400
    assert sim_stats(sim)["template_requests"] == {"tokenize": 2, "detokenize": 1}
