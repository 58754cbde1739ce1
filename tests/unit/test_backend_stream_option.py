"""``?stream=1`` on a backend URL: parsed into ``BackendTarget.stream``, honoured by the
registry."""

from __future__ import annotations

from typing import Any

import pytest

from agentbatch.backends import registry
from agentbatch.backends.openai_compat import DynamoBackend, OpenAICompatBackend
from agentbatch.backends.registry import backend_from_url
from agentbatch.backends.urls import parse_backend_url
from agentbatch.core.errors import BatchSpecError
from agentbatch.core.model_io import ModelRequest


@pytest.fixture(autouse=True)
def _no_openai_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)


@pytest.mark.parametrize(
    "url",
    [
        "vllm://h:8000?stream=1",
        "sglang://h:30000/v1?stream=true",
        "dynamo://h:8000?stream=yes",
        "sim://127.0.0.1:9?stream",
        "http://h:8000/v1?stream=1",
        "https://proxy.example.com/llm?stream=1",
        "vllm+https://h?model=qwen&stream=on",
    ],
)
def test_stream_query_turns_streaming_on(url: str) -> None:
    t = parse_backend_url(url)
    assert t.stream is True
    assert "stream" not in t.base_url and "?" not in t.base_url


@pytest.mark.parametrize("url", ["vllm://h:8000?stream=0", "sim://h:1?stream=false&model=m",
                                 "llamacpp://h:1?stream=0"])
def test_stream_query_turns_streaming_off(url: str) -> None:
    assert parse_backend_url(url).stream is False


@pytest.mark.parametrize(("url", "streams"), [("vllm://h:8000", False), ("sim://h:1", False),
                                              ("http://h:1/v1", False),
                                              ("llamacpp://h:1", True),
                                              ("llamacpp://h:1?stream=0", False)])
async def test_without_the_option_each_driver_keeps_its_default(url: str, streams: bool) -> None:
    """Off, except on llama.cpp, where only a streamed reply can be stopped when it loops."""
    assert parse_backend_url(url.split("?")[0]).stream is None
    backend = backend_from_url(url)
    try:
        assert backend.stream is streams  # type: ignore[attr-defined]
    finally:
        await backend.aclose()  # type: ignore[attr-defined]


def test_model_and_stream_together() -> None:
    t = parse_backend_url("vllm://h:8000/v1?model=Qwen/Qwen2.5-7B&stream=1")
    assert (t.base_url, t.model, t.stream) == ("http://h:8000", "Qwen/Qwen2.5-7B", True)


def test_stream_with_openai_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    t = parse_backend_url("openai://?stream=1")
    assert t.stream and t.api_key == "sk-test"


@pytest.mark.parametrize("url", ["vllm://h?stream=maybe", "sim://h:1?stream=2"])
def test_a_bad_stream_value_is_a_spec_error(url: str) -> None:
    with pytest.raises(BatchSpecError, match="stream"):
        parse_backend_url(url)


@pytest.mark.parametrize("url", ["anthropic://?stream=1", "bedrock://us-east-1/m?stream=1"])
def test_stream_is_refused_where_no_openai_compatible_driver_speaks(url: str) -> None:
    with pytest.raises(BatchSpecError, match="OpenAI-compatible"):
        parse_backend_url(url, api_key="k")


async def test_registry_builds_a_streaming_backend() -> None:
    streaming = backend_from_url("sim://127.0.0.1:9?stream=1")
    plain = backend_from_url("sim://127.0.0.1:9")
    dynamo = backend_from_url("dynamo://127.0.0.1:9?stream=1")
    try:
        assert isinstance(streaming, OpenAICompatBackend) and streaming.stream is True
        assert isinstance(plain, OpenAICompatBackend) and plain.stream is False
        assert isinstance(dynamo, DynamoBackend) and dynamo.stream is True
        body = streaming.build_body(
            ModelRequest(model="m", messages=[{"role": "user", "content": "x"}])
        )
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    finally:
        for b in (streaming, plain, dynamo):
            await b.aclose()


def test_drivers_that_cannot_stream_are_not_passed_the_option(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[dict[str, Any]] = []

    def factory(target: Any, **kwargs: Any) -> Any:
        seen.append(kwargs)
        return object()

    monkeypatch.setitem(registry._DRIVERS, "sim", "fake:factory")
    monkeypatch.setattr(registry, "_load", lambda scheme, path: factory)
    backend_from_url("sim://h:1")
    backend_from_url("sim://h:1?stream=1")
    assert "stream" not in seen[0]
    assert seen[1]["stream"] is True
