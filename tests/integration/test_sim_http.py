"""The simulator over real HTTP: conversations, streaming, batch prompts, faults, metrics, modes.

No assertion depends on timing; concurrency is checked through the server's own counters.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Literal

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel

from agentbatch.sim import SimConfig, SimProcess, SimServer

TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
    for n in ("read_file", "search")
]


class Finding(BaseModel):
    path: str
    severity: Literal["low", "high"]
    line: int | None = None


class Report(BaseModel):
    summary: str
    findings: list[Finding]
    done: bool


REPORT_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "Report", "schema": Report.model_json_schema()},
}


@pytest.fixture(scope="module")
def sim() -> Iterator[SimServer]:
    with SimServer(fixed_ms=1, timeout_hold_s=5) as server:
        yield server


@pytest.fixture
def client(sim: SimServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=sim.url, timeout=10) as c:
        yield c


def user(text: str) -> list[dict]:
    return [
        {"role": "system", "content": "You are a test agent."},
        {"role": "user", "content": text},
    ]


def chat(client: httpx.Client, messages: list[dict], **extra) -> httpx.Response:
    return client.post("/v1/chat/completions", json={"model": "sim", "messages": messages, **extra})


def test_health_models_and_reset(client: httpx.Client):
    assert client.get("/health").text == "ok"
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["agentbatch-sim"]
    assert client.post("/sim/reset").json() == {"ok": True}
    assert client.get("/sim/stats").json()["requests_total"] == 0
    assert chat(client, []).status_code == 400
    assert chat(client, ["not a message"]).status_code == 400
    assert client.post("/v1/chat/completions", content=b"nope").status_code == 400


def test_two_tool_rounds_then_schema_answer(client: httpx.Client):
    messages = user(
        'Audit the repo.\n@sim tool read_file {"path": "main.py"}\n'
        '@sim tool search {"query": "TODO"}\n'
    )
    calls = []
    for _ in range(2):
        body = chat(client, messages, tools=TOOLS, response_format=REPORT_FORMAT).json()
        choice = body["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        msg = choice["message"]
        (call,) = msg["tool_calls"]
        calls.append((call["function"]["name"], json.loads(call["function"]["arguments"])))
        messages += [msg, {"role": "tool", "tool_call_id": call["id"], "content": "result"}]
    assert calls == [("read_file", {"path": "main.py"}), ("search", {"query": "TODO"})]
    body = chat(client, messages, tools=TOOLS, response_format=REPORT_FORMAT).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
    report = Report.model_validate_json(choice["message"]["content"])
    assert report.findings and report.done is True
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 0


def read_sse(response: httpx.Response) -> list[dict]:
    lines = [line for line in response.text.split("\n\n") if line.strip()]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_streaming_tool_call_reassembles(client: httpx.Client):
    args = {"path": "some/long/path/to/a/file.py", "encoding": "utf-8"}
    messages = user(f"@sim tool read_file {json.dumps(args)}")
    resp = chat(client, messages, tools=TOOLS, stream=True, stream_options={"include_usage": True})
    assert resp.headers["content-type"].startswith("text/event-stream")
    chunks = read_sse(resp)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1
    pieces = [tc for c in chunks for ch in c["choices"] for tc in ch["delta"].get("tool_calls", [])]
    head = pieces[0]
    assert head["index"] == 0 and head["id"].startswith("call_") and head["type"] == "function"
    assert head["function"]["name"] == "read_file"
    arg_pieces = [p["function"]["arguments"] for p in pieces[1:]]
    assert len(arg_pieces) >= 2
    assert json.loads("".join(arg_pieces)) == args
    assert [c for c in chunks if c["choices"]][-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_streaming_text_answer(client: httpx.Client):
    resp = chat(client, user("@sim answer hello streaming world"), stream=True)
    chunks = read_sse(resp)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == "hello streaming world"
    assert "usage" not in chunks[-1]


def test_batch_completions(client: httpx.Client):
    prompts = ["first prompt", "@sim answer second", "third prompt"]
    body = client.post("/v1/completions", json={"model": "sim", "prompt": prompts}).json()
    assert body["object"] == "text_completion"
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["choices"][1]["text"] == "second"
    assert body["choices"][0]["text"] != body["choices"][2]["text"]
    single = client.post("/v1/completions", json={"model": "sim", "prompt": "third prompt"}).json()
    assert single["choices"][0]["text"] == body["choices"][2]["text"]
    bad = client.post("/v1/completions", json={"model": "sim", "prompt": [1, 2]})
    assert bad.status_code == 400


def test_streaming_batch_completions(client: httpx.Client):
    prompts = ["@sim answer alpha beta gamma", "@sim answer delta"]
    resp = client.post("/v1/completions", json={"prompt": prompts, "stream": True})
    texts = {0: "", 1: ""}
    for chunk in read_sse(resp):
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["text"]
    assert texts == {0: "alpha beta gamma", 1: "delta"}


def test_http_500_then_success(client: httpx.Client):
    messages = user("flaky\n@sim fail http_500 times=2")
    for _ in range(2):
        resp = chat(client, messages)
        assert resp.status_code == 500 and "error" in resp.json()
    assert chat(client, messages).status_code == 200


def test_http_429_with_retry_after(client: httpx.Client):
    messages = user("busy\n@sim fail http_429 retry_after=0.05")
    resp = chat(client, messages)
    assert resp.status_code == 429
    assert resp.headers["Retry-After"] == "0.05"
    assert resp.json()["error"]["message"]
    assert chat(client, messages).status_code == 200


def test_malformed_json_then_schema_answer(client: httpx.Client):
    messages = user("json please\n@sim fail malformed_json")
    first = chat(client, messages, response_format=REPORT_FORMAT).json()["choices"][0]["message"]
    with pytest.raises(ValueError):
        json.loads(first["content"])
    second = chat(client, messages, response_format=REPORT_FORMAT).json()
    Report.model_validate_json(second["choices"][0]["message"]["content"])


def test_bad_tool_call(client: httpx.Client):
    messages = user('@sim tool read_file {"path": "x.py"}\n@sim fail bad_tool_call')
    msg = chat(client, messages, tools=TOOLS).json()["choices"][0]["message"]
    (call,) = msg["tool_calls"]
    assert call["function"]["name"] == "read_file"
    with pytest.raises(ValueError):
        json.loads(call["function"]["arguments"])
    messages += [msg, {"role": "tool", "tool_call_id": call["id"], "content": "error: bad args"}]
    retry = chat(client, messages, tools=TOOLS).json()["choices"][0]["message"]
    assert json.loads(retry["tool_calls"][0]["function"]["arguments"]) == {"path": "x.py"}
    unknown = chat(client, user("no tools pending\n@sim fail bad_tool_call"), tools=TOOLS).json()
    assert unknown["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "no_such_tool"


def test_timeout_holds_only_that_request(sim: SimServer, client: httpx.Client):
    messages = user("slow\n@sim fail timeout")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            sim.url + "/v1/chat/completions",
            json={"model": "sim", "messages": messages},
            timeout=httpx.Timeout(10, read=0.3),
        )
    assert chat(client, messages).status_code == 200  # second attempt behaves
    assert client.get("/sim/stats").json()["faults"]["timeout"] >= 1


def test_cached_tokens_for_shared_system_prompt(client: httpx.Client):
    system = "Shared policy for the cache test. " * 60
    usages = []
    for task in ("first task", "second task"):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": task}]
        usages.append(chat(client, messages).json()["usage"])
    assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] >= len(system) // 4 - 16


def test_metrics_exposes_vllm_names(client: httpx.Client):
    chat(client, user("metrics warmup"))
    text = client.get("/metrics").text
    samples = {  # labels in any order, as prometheus_client sorts them
        s.name: s for family in text_string_to_metric_families(text) for s in family.samples
    }
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:gpu_cache_usage_perc",
        "vllm:gpu_prefix_cache_hit_rate",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:time_to_first_token_seconds_bucket",
    ):
        assert samples[name].labels["model_name"] == "agentbatch-sim", name
    assert samples["vllm:prompt_tokens_total"].value > 0
    assert samples["vllm:time_to_first_token_seconds_count"].value >= 1


def test_random_fault_injection_is_seeded():
    def run() -> list[int]:
        config = SimConfig(fixed_ms=0, fault_rates={"http_500": 0.5}, seed=3)
        with SimServer(config) as server, httpx.Client(base_url=server.url) as c:
            return [chat(c, user(f"chaos {i}")).status_code for i in range(20)]

    first = run()
    assert first == run()
    assert set(first) == {200, 500}


async def test_gpu_like_mode_queues_beyond_max_running():
    config = SimConfig(max_running=2, decode_ms=2.0, prefill_ms_per_token=0.0)
    with SimServer(config) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as ac:

            async def one(i: int) -> httpx.Response:
                body = {"model": "sim", "messages": user(f"job {i}\n@sim tokens 60")}
                return await ac.post("/v1/chat/completions", json=body)

            responses = await asyncio.gather(*(one(i) for i in range(6)))
            assert all(r.status_code == 200 for r in responses)
            assert all(r.json()["usage"]["completion_tokens"] == 60 for r in responses)
            stats = (await ac.get("/sim/stats")).json()
            metrics = (await ac.get("/metrics")).text
    assert stats["max_running_seen"] == 2
    assert stats["max_waiting_seen"] >= 1
    assert stats["success"] == 6 and stats["running"] == 0 and stats["waiting"] == 0
    assert 'vllm:num_requests_waiting{model_name="agentbatch-sim"} 0.0' in metrics


async def test_gpu_like_mode_rejects_when_waiting_queue_full():
    config = SimConfig(max_running=1, max_waiting=1, decode_ms=5.0, queue_full_retry_after_s=0.5)
    with SimServer(config) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as ac:
            body = {"messages": user("long job\n@sim tokens 200")}
            responses = await asyncio.gather(
                *(ac.post("/v1/chat/completions", json=body) for _ in range(4))
            )
            stats = (await ac.get("/sim/stats")).json()
    rejected = [r for r in responses if r.status_code == 429]
    assert rejected and rejected[0].headers["Retry-After"] == "0.5"
    assert stats["rejected_queue_full"] == len(rejected)


def test_sim_process_lifecycle():
    with SimProcess(SimConfig(fixed_ms=1)) as proc:
        assert httpx.get(proc.url + "/health").text == "ok"
        resp = httpx.post(proc.url + "/v1/chat/completions", json={"messages": user("hi")})
        assert resp.json()["choices"][0]["message"]["content"].startswith("sim answer")
        pid = proc.proc.pid
        popen = proc.proc
    assert popen.poll() is not None and pid > 0
    assert proc.proc is None


def test_sim_process_reports_startup_failure():
    with pytest.raises(RuntimeError, match="exited") as info:
        SimProcess(SimConfig(fixed_ms=1, port=-5), startup_timeout_s=30).start()
    assert "stderr" in str(info.value) and "port" in str(info.value).lower()


def test_client_disconnect_aborts_the_sequence():
    config = SimConfig(max_running=1, decode_ms=1.0)
    with SimServer(config) as server, httpx.Client(base_url=server.url) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post(
                "/v1/chat/completions",
                json={"messages": user("endless\n@sim tokens 100000000")},
                timeout=httpx.Timeout(10, read=0.3),
            )
        stats = c.get("/sim/stats").json()
        for _ in range(200):  # the server notices the disconnect asynchronously
            if stats["running"] == 0:
                break
            time.sleep(0.05)
            stats = c.get("/sim/stats").json()
        assert stats["running"] == 0 and stats["max_running_seen"] == 1
        assert chat(c, user("next")).status_code == 200  # the slot was freed
