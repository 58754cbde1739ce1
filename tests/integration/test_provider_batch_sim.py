"""Provider batch clients against the simulator's batch APIs over real HTTP: OpenAI's files +
batches and Anthropic's message batches. A batch of N round-trips by custom_id (each answer
is the one the sync API gives for the same request); partial failures, expiry and cancel come
back as structured per-request errors; discovery at warm-up says which servers have the API."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from agentbatch.backends.anthropic import AnthropicBackend
from agentbatch.backends.base import Backend
from agentbatch.backends.openai_compat import OpenAICompatBackend
from agentbatch.backends.provider_batch import ProviderBatchClient, batch_client
from agentbatch.core.errors import BackendTimeout, BatchSpecError
from agentbatch.core.model_io import ModelRequest
from agentbatch.sim import SimServer
from agentbatch.sim.batch_api import BATCH_API
from agentbatch.sim.config import SimConfig
from tests.support.http_server import ThreadedServer
from tests.support.provider_batch import chat_only

MODEL = "sim-model"
WAIT_S = 120.0  # generous: the machine is shared
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Look a key up.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}},
                   "required": ["key"]}}}


def _request(i: int, extra: str = "") -> ModelRequest:
    text = f'Agent {i}.\n@sim tool lookup {{"key": "k{i}"}}' if i % 2 else f"Agent {i}."
    return ModelRequest(model=MODEL, messages=[{"role": "user", "content": text + extra}],
                        tools=[LOOKUP], max_tokens=64)


def _backend(kind: str, sim: SimServer) -> Backend:
    hostport = sim.url.split("://", 1)[1]
    if kind == "openai":
        return OpenAICompatBackend(f"sim://{hostport}")
    return AnthropicBackend(f"anthropic://{hostport}", api_key="sk-ant-test")


def _run(kind: str, config: SimConfig,
         body: Callable[[ProviderBatchClient, Backend, SimServer], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        with SimServer(config) as sim:
            backend = _backend(kind, sim)
            client = await batch_client(backend)
            assert client is not None, f"{kind}: the sim's batch API was not discovered"
            try:
                return await body(client, backend, sim)
            finally:
                await client.aclose()
                await backend.aclose()
    return asyncio.run(main())


KINDS = ["openai", "anthropic"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_batch_of_n_round_trips_by_custom_id(kind: str) -> None:
    n = 24
    requests = [(f"agent-{i}-turn-0", _request(i)) for i in reversed(range(n))]

    async def body(client: ProviderBatchClient, backend: Backend, sim: SimServer) -> None:
        created = await client.submit(requests)
        assert not created.ended
        state = await client.wait(created.id, timeout_s=WAIT_S, poll_s=0.1)
        assert state.ended and state.status in ("completed", "ended")
        results = await client.results(created.id, [cid for cid, _ in requests])
        assert sorted(results) == sorted(cid for cid, _ in requests)
        # the sim serves no sync /v1/messages: its chat completions answer the same script
        chat = _backend("openai", sim)
        for cid, request in requests:
            got = results[cid]
            assert got.ok and got.error is None, got.error
            sync = await chat.complete(request)  # the same request through the sync API
            assert got.response is not None
            assert got.response.text == sync.text
            assert [(c.name, c.arguments) for c in got.response.tool_calls] == \
                [(c.name, c.arguments) for c in sync.tool_calls]
            assert got.response.usage.prompt_tokens > 0
            assert got.response.usage.completion_tokens > 0
        await chat.aclose()
        odd = results["agent-3-turn-0"].response
        assert odd is not None and odd.tool_calls[0].arguments == {"key": "k3"}

    _run(kind, SimConfig(fixed_ms=1, batch_latency_s=0.3, batch_latency_spread=0.5), body)


@pytest.mark.parametrize("kind", KINDS)
def test_partial_failures_are_per_request_errors(kind: str) -> None:
    failing = {2, 5, 6}
    requests = [(f"r{i}", _request(i, "\n@simbatch fail" if i in failing else ""))
                for i in range(10)]

    async def body(client: ProviderBatchClient, backend: Backend, sim: SimServer) -> None:
        created = await client.submit(requests)
        await client.wait(created.id, timeout_s=WAIT_S, poll_s=0.1)
        results = await client.results(created.id, [cid for cid, _ in requests])
        assert {cid for cid, r in results.items() if not r.ok} == {f"r{i}" for i in failing}
        for i in failing:
            err = results[f"r{i}"].error
            assert err is not None and err.kind == "server_error" and err.retryable
            assert "simulated batch request failure" in err.message or "500" in err.message

    _run(kind, SimConfig(fixed_ms=1, batch_latency_s=0.1, batch_latency_spread=0.2), body)


@pytest.mark.parametrize("kind", KINDS)
def test_expiry_answers_the_finished_requests_and_expires_the_rest(kind: str) -> None:
    held = {0, 3}
    requests = [(f"e{i}", _request(i, "\n@simbatch hold" if i in held else ""))
                for i in range(6)]

    async def body(client: ProviderBatchClient, backend: Backend, sim: SimServer) -> None:
        created = await client.submit(requests)
        state = await client.wait(created.id, timeout_s=WAIT_S, poll_s=0.1)
        assert state.status in ("expired", "ended")
        results = await client.results(created.id, [cid for cid, _ in requests])
        for i in range(6):
            got = results[f"e{i}"]
            if i in held:
                assert got.error is not None and got.error.kind == "expired", got
                assert got.error.retryable
            else:
                assert got.ok, got.error

    _run(kind, SimConfig(fixed_ms=1, batch_latency_s=0.05, batch_latency_spread=0.0,
                         batch_expire_s=1.0), body)


@pytest.mark.parametrize("kind", KINDS)
def test_cancel_keeps_answered_requests_and_cancels_the_rest(kind: str) -> None:
    held = {1, 2, 4}
    requests = [(f"c{i}", _request(i, "\n@simbatch hold" if i in held else ""))
                for i in range(5)]

    async def body(client: ProviderBatchClient, backend: Backend, sim: SimServer) -> None:
        created = await client.submit(requests)
        with pytest.raises(BackendTimeout, match="still"):
            await client.wait(created.id, timeout_s=0.3, poll_s=0.1)  # held: never ends
        await client.cancel(created.id)
        state = await client.wait(created.id, timeout_s=WAIT_S, poll_s=0.1)
        assert state.status in ("cancelled", "ended")
        results = await client.results(created.id, [cid for cid, _ in requests])
        assert {cid for cid, r in results.items() if r.ok} == {"c0", "c3"}
        for i in held:
            err = results[f"c{i}"].error
            assert err is not None and err.kind == "cancelled" and err.retryable

    # latency 0: the requests not held are answered at creation, before the cancel
    _run(kind, SimConfig(fixed_ms=1, batch_latency_s=0.0, batch_expire_s=3600.0), body)


@pytest.mark.parametrize("kind", KINDS)
def test_bad_requests_are_refused_before_anything_is_uploaded(kind: str) -> None:
    async def body(client: ProviderBatchClient, backend: Backend, sim: SimServer) -> None:
        with pytest.raises(BatchSpecError, match="custom_id 'x' is repeated"):
            await client.submit([("x", _request(1)), ("x", _request(2))])
        with pytest.raises(BatchSpecError, match="custom_id must be a non-empty string"):
            await client.submit([("", _request(1))])
        with pytest.raises(BatchSpecError, match="at least one request"):
            await client.submit([])
        api = sim._runner.app[BATCH_API]  # type: ignore[union-attr]
        assert not api.files and not api.jobs

    _run(kind, SimConfig(fixed_ms=1), body)


@pytest.mark.parametrize("kind", KINDS)
def test_a_server_without_the_batch_api_is_found_out_at_warm_up(kind: str) -> None:
    with ThreadedServer(chat_only) as server:
        url = f"{'sim' if kind == 'openai' else 'anthropic'}://127.0.0.1:{server.port}"

        async def main() -> None:
            backend: Backend = (OpenAICompatBackend(url) if kind == "openai"
                                else AnthropicBackend(url, api_key="sk-ant-test"))
            try:
                assert await batch_client(backend) is None
            finally:
                await backend.aclose()
        asyncio.run(main())


def test_the_openai_input_file_holds_one_jsonl_line_per_request_with_its_custom_id() -> None:
    async def body(client: ProviderBatchClient, backend: Backend, sim: SimServer) -> None:
        await client.submit([("a", _request(1)), ("b", _request(2))])
        api = sim._runner.app[BATCH_API]  # type: ignore[union-attr]
        ((_, content),) = api.files.values()
        lines = [json.loads(raw) for raw in content.decode().splitlines()]
        assert [(x["custom_id"], x["method"], x["url"]) for x in lines] == \
            [("a", "POST", "/v1/chat/completions"), ("b", "POST", "/v1/chat/completions")]
        assert lines[0]["body"]["model"] == MODEL and "stream" not in lines[0]["body"]

    _run("openai", SimConfig(fixed_ms=1), body)


def test_anthropic_batch_turns_mark_the_shared_prefix_for_the_1_hour_cache() -> None:
    # a batch round is minutes to hours long: the default 5-minute cache would be gone by an
    # agent's next turn; the sync API keeps the default
    def request(i: int) -> ModelRequest:
        return ModelRequest(model=MODEL, tools=[LOOKUP], max_tokens=64, messages=[
            {"role": "system", "content": "You look records up."},
            {"role": "user", "content": f"Agent {i}."}])

    async def body(client: ProviderBatchClient, backend: Backend, sim: SimServer) -> None:
        await client.submit([("a", request(1)), ("b", request(2))])
        api = sim._runner.app[BATCH_API]  # type: ignore[union-attr]
        ((job),) = api.jobs.values()
        sent = {r["custom_id"]: r["params"] for r in job.meta["requests"]}
        one_hour = {"type": "ephemeral", "ttl": "1h"}
        for params in sent.values():
            assert params["system"][-1]["cache_control"] == one_hour
            assert params["tools"][-1]["cache_control"] == one_hour
            marked = [b for b in [*params["system"], *params["tools"]] if "cache_control" in b]
            assert len(marked) == 2  # the shared prefix only, no per-agent breakpoint
            assert all("cache_control" not in str(m) for m in params["messages"])
        assert isinstance(backend, AnthropicBackend)
        sync = backend.build_body(request(1))
        assert sync["system"][-1]["cache_control"] == {"type": "ephemeral"}

    _run("anthropic", SimConfig(fixed_ms=1), body)


def test_the_batch_flags_reach_the_config_and_bad_values_are_refused() -> None:
    from agentbatch.sim.__main__ import config_from_args
    from agentbatch.sim.config import config_to_argv

    config = config_from_args(["--batch-latency-s", "30", "--batch-latency-spread", "0.8",
                               "--batch-expire-s", "600", "--batch-failure-rate", "0.1"])
    assert (config.batch_latency_s, config.batch_latency_spread, config.batch_expire_s,
            config.batch_failure_rate) == (30.0, 0.8, 600.0, 0.1)
    assert config_from_args(config_to_argv(config)) == config
    with pytest.raises(ValueError, match="batch_failure_rate"):
        SimConfig(batch_failure_rate=1.5)
    with pytest.raises(ValueError, match="batch_expire_s"):
        SimConfig(batch_expire_s=0)
