"""Context limits against the real engine: llama-server (SmolLM2-135M) with a small context.

The server runs 2 slots of 1,024 tokens (``--ctx-size 2048 --parallel 2``); a prompt must fit
one slot. The agent's first turn must call the tool (json tool calling, ``tool_choice=
"required"``), whose output is ~1,500 tokens: the next prompt does not fit. What is asserted
is what agentbatch decides, not what the tiny model says: without compaction the agent ends
``context_overflow`` before the prompt is sent; with ``compaction="truncate"`` the output is
cut and the turns go on; no request ever comes back as the server's context-length error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from agentbatch import AgentResult, submit_batch, tool
from agentbatch.backends.registry import backend_from_url
from agentbatch.engine import EnginePaths, LlamaServer

pytestmark = [pytest.mark.engine]

CTX_PER_SLOT = 1024
SYSTEM = ("You look things up. Call the lookup tool with the topic, read its result, then "
          "give a one-sentence final answer.")


@tool
def lookup(topic: str) -> str:
    """Look a topic up.

    Args:
        topic: what to look up.
    """
    return f"Notes on {topic}: " + "the kettle boils water quickly and safely. " * 140


@pytest.fixture(scope="module")
def small_server(engine_paths: EnginePaths) -> Iterator[LlamaServer]:
    with LlamaServer(engine_paths, parallel=2, ctx_per_slot=CTX_PER_SLOT) as server:
        yield server


def _run(server: LlamaServer, **options: object) -> list[AgentResult]:
    handle = submit_batch("Tell me about {topic}.", [{"topic": "kettles"}, {"topic": "tea"}],
                          model="smollm2", backend=server.llamacpp_url, system_prompt=SYSTEM,
                          tools=[lookup], tool_calling="json", tool_choice="required",
                          max_tokens=64, temperature=0.0, max_turns=3, **options)
    return handle.wait(timeout=900)


def test_the_context_is_one_slots_n_ctx(small_server: LlamaServer) -> None:
    async def ask() -> tuple[int | None, int | None]:
        backend = backend_from_url(small_server.llamacpp_url)
        try:
            return (await backend.context_length(),
                    await backend.count_tokens([{"role": "user", "content": "hello there"}]))
        finally:
            await backend.aclose()

    context, counted = asyncio.run(ask())
    assert context == CTX_PER_SLOT  # --ctx-size / --parallel, from /props
    assert counted is not None and 0 < counted < 100  # the server's template and tokenizer


def test_without_compaction_the_agents_end_context_overflow(small_server: LlamaServer) -> None:
    results = _run(small_server)
    print("no compaction:", [(r.ok, r.error, len(r.tool_calls)) for r in results])
    for r in results:
        assert r.error is not None and r.error.kind == "context_overflow", r.error
        assert f"the context of {CTX_PER_SLOT} tokens" in r.error.message
        assert "(counted)" in r.error.message  # sized with the server's /tokenize
        assert [c.name for c in r.tool_calls] == ["lookup"]


def test_with_truncate_the_turns_fit_and_the_server_never_refuses(
        small_server: LlamaServer) -> None:
    results = _run(small_server, compaction="truncate")
    print("truncate:", [(r.ok, r.error, len(r.tool_calls), r.usage) for r in results])
    for r in results:
        assert r.error is None or r.error.kind not in ("context_overflow", "bad_request",
                                                       "server_error"), r.error
        assert r.turns >= 2  # the turn after the long tool output was sent and answered
    # Whether the tiny model then writes a valid answer is the model's business, not asserted.
