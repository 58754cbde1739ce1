"""More agents than slots on one llama-server: a turn whose slot another agent took goes without
``id_slot``, so llama.cpp restores its conversation from the host-memory prompt cache.

With ``--slot-prompt-similarity 0`` (``LlamaServer``'s, and the pool benchmark's), llama.cpp
saves a slot's conversation to its host-memory cache and restores the best cached match only
for a request it places itself; a request naming ``id_slot`` takes the slot as it is
(``server-context.cpp``, ``get_available_slot``), discarding another agent's conversation
unsaved and computing its own again. Three agents take turns one after another on two slots,
so the server's choices are deterministic; the test asserts the ``id_slot`` agentbatch sent
(and that it asked where each unpinned turn ran), where it then believes each conversation
is, and the prompt tokens each second turn computed, read from the server's reply.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agentbatch.backends.llamacpp import LlamaCppBackend, SlotPicker
from agentbatch.core.model_io import ModelRequest, ModelResponse
from agentbatch.engine import EnginePaths, LlamaServer
from tests.engine.test_llamacpp_warmup import MODEL, SYSTEM

pytestmark = pytest.mark.engine

AGENTS = ("t:0", "t:1", "t:2")
PAGE = ("Section {n}: the pump must be primed before first use; check the seal, the valve and "
        "the filter, and write the reading in the log book with the date. ") * 4


def _messages(agent: str, turn: int) -> list[dict[str, Any]]:
    """An agent's conversation at ``turn`` (1-based): the same system prompt, its own case,
    then one page per turn (fixed assistant replies, so the prompts do not depend on the
    model)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": f"Case {agent}: page 1."}]
    for n in range(1, turn + 1):
        if n > 1:
            messages += [{"role": "assistant", "content": f"Read page {n - 1}."},
                         {"role": "user", "content": f"Page {n}."}]
        messages[-1] = {"role": "user", "content": messages[-1]["content"] + " "
                        + PAGE.format(n=n)}
    return messages


async def _turns(url: str) -> tuple[list[dict[str, Any]], list[ModelResponse],
                                    dict[str, int], list[str | None]]:
    """Warm-up probe, then turn 1 of each agent, then turn 2 of each, one at a time: the
    bodies sent, the replies, and the picker's view after."""
    backend = LlamaCppBackend(url)
    sent: list[dict[str, Any]] = []
    build = backend.build_body

    def recording(request: ModelRequest) -> dict[str, Any]:
        body = build(request)
        sent.append(body)
        return body

    backend.build_body = recording  # type: ignore[method-assign]
    replies: list[ModelResponse] = []
    try:
        probe = await backend.probe_cache(ModelRequest(
            model=MODEL, max_tokens=1, agent_key="t:warmup",
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "ok"}]))
        assert probe is not None and probe.pinning_keeps_prefix, probe
        for turn in (1, 2):
            for agent in AGENTS:
                replies.append(await backend.complete(ModelRequest(
                    model=MODEL, max_tokens=1, temperature=0.0, agent_key=agent,
                    messages=_messages(agent, turn))))
        picker = backend._picker
        assert picker is not None
        return ([b for b in sent if b["max_tokens"] == 1], replies,
                dict(picker.homes), list(picker.holds))
    finally:
        await backend.aclose()


def test_a_turn_whose_slot_another_agent_took_is_restored_from_host_memory(
        engine_paths: EnginePaths) -> None:
    server = LlamaServer(engine_paths, parallel=2).start()
    try:
        bodies, replies, homes, holds = asyncio.run(_turns(server.llamacpp_url))
    finally:
        server.stop()
    assert len(bodies) == 6
    # Turn 1: two agents pinned to the two slots; the third finds both holding another
    # agent's conversation, so the server picks (and saves what it evicts).
    # Turn 2: each agent's slot holds someone else's conversation by then: no id_slot.
    assert [b.get("id_slot") for b in bodies] == [0, 1, None, None, None, None]
    for body in bodies[2:]:  # an unpinned turn asks where it ran
        assert body["verbose"] is True and body["response_fields"] == ["id_slot"]
    # llama.cpp placed each unpinned turn on its idle slot used longest ago, as predicted:
    # t:2 on 0, then t:0 on 1, t:1 on 0, t:2 on 1.
    assert homes == {"t:0": 1, "t:1": 0, "t:2": 1}
    assert holds == ["t:1", "t:2"]
    # Each second turn found its whole first turn cached (restored from host memory), so it
    # computed its new page and little else; pinned to its old slot it would have computed
    # its whole conversation again (the system prompt excepted).
    first, second = replies[:3], replies[3:]
    for one, two in zip(first, second, strict=True):
        computed = two.usage.prompt_tokens - two.usage.cached_tokens
        assert two.usage.cached_tokens >= one.usage.prompt_tokens - 8, (one.usage, two.usage)
        assert computed <= two.usage.prompt_tokens - one.usage.prompt_tokens + 8, two.usage


@pytest.mark.parametrize("stream", [True, False])
def test_an_unpinned_turn_is_recorded_on_the_slot_the_server_says_it_ran_on(
        engine_paths: EnginePaths, stream: bool) -> None:
    """The picker's guess of the server's pick is only a guess: where an unpinned turn ran is
    read from the reply (``__verbose.id_slot``), streamed or not. Here the guess is made wrong
    on purpose, and the slot recorded is the one ``/slots`` shows the turn ran on."""
    server = LlamaServer(engine_paths, parallel=2).start()

    async def run() -> dict[str, int]:
        backend = LlamaCppBackend(server.llamacpp_url + ("" if stream else "?stream=0"))
        try:
            await backend.props()
            picker = backend._picker = SlotPicker(2)
            picker.holds = ["x", "y"]  # both hold another agent's conversation: unpinned
            picker.last_used = [0.0, 5e9]  # so the guess is slot 0
            await backend.complete(ModelRequest(
                model=MODEL, max_tokens=2, agent_key="t:0",
                messages=[{"role": "user", "content": "hi"}]))
            return dict(picker.homes)
        finally:
            await backend.aclose()

    try:
        homes = asyncio.run(run())
        ran = [s["id"] for s in server.get_json("/slots") if "id_task" in s]
    finally:
        server.stop()
    assert len(ran) == 1 and homes == {"t:0": ran[0]}, (homes, ran)
