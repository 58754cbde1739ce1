"""A backend that answers 307 must not get the prompt re-POSTed to another origin (item 12a).

Server A redirects every request to server B, both real HTTP servers on 127.0.0.1. A 307
keeps the method and body, so following it would hand B the whole prompt (and, with a key,
its Authorization header). B must receive nothing, and the error must say where A pointed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from agentbatch.backends.anthropic import AnthropicBackend
from agentbatch.backends.openai_compat import OpenAICompatBackend
from agentbatch.core.errors import BadRequest
from agentbatch.core.model_io import ModelRequest
from tests.support.recording_http import RecordingServer

PROMPT = "the private prompt that must stay with A"


@pytest.fixture
def servers() -> Iterator[tuple[RecordingServer, RecordingServer]]:
    b = RecordingServer().start()
    a = RecordingServer(redirect_to=b.url).start()
    yield a, b
    a.stop()
    b.stop()


def _request() -> ModelRequest:
    return ModelRequest(model="m", messages=[{"role": "user", "content": PROMPT}])


@pytest.mark.parametrize("stream", [False, True])
async def test_openai_compatible_post_does_not_follow_a_307(
        servers: tuple[RecordingServer, RecordingServer], stream: bool) -> None:
    a, b = servers
    backend = OpenAICompatBackend(f"vllm://{a.netloc}", stream=stream, timeout=30)
    try:
        with pytest.raises(BadRequest, match="307 redirect to"):
            await backend.complete(_request())
    finally:
        await backend.aclose()
    assert len(a.requests) == 1 and PROMPT in a.requests[0].body.decode()
    assert b.requests == []


async def test_anthropic_post_does_not_follow_a_307(
        servers: tuple[RecordingServer, RecordingServer],
        monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = servers
    monkeypatch.setenv("LOCAL_KEY", "sk-local")
    monkeypatch.setenv("AGENTBATCH_API_KEYS", json.dumps({a.netloc: "LOCAL_KEY"}))
    backend = AnthropicBackend(f"anthropic://{a.netloc}", timeout=30)
    try:
        with pytest.raises(BadRequest, match="307 redirect to"):
            await backend.complete(_request())
    finally:
        await backend.aclose()
    assert len(a.requests) == 1
    assert b.requests == []
