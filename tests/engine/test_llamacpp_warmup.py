"""What agentbatch decides at warm-up on llama-server: the cache probe's warning, and id_slot.

A setting of the server that defeats its prompt cache cannot be read from ``/props`` or
``/slots`` on this build, so the ``llamacpp://`` backend repeats the warm-up request and reads
the cached-token count (``LlamaCppBackend.probe_cache``). These tests start servers with and
without such a setting and assert on what agentbatch logged and on the request bodies it sent,
never on the server's scheduling or on what the model wrote.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from agentbatch import arun_batch
from agentbatch.backends.llamacpp import CacheProbe, LlamaCppBackend, Placement, SlotPicker
from agentbatch.core.model_io import ModelRequest
from agentbatch.engine import EnginePaths, LlamaServer
from agentbatch.engine.server import cache_defeating_flags
from tests.engine.reviews import TASK, Verdict, inputs

pytestmark = pytest.mark.engine

MODEL = "smollm2"
LOGGER = "agentbatch.backends.llamacpp"
SYSTEM = (
    "You label short product reviews for a shop. Read the review, decide whether the "
    "customer was happy, and give a very short reason in plain words. " * 8
).strip()


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and r.levelno >= logging.WARNING]


@pytest.fixture
def server_factory(engine_paths: EnginePaths) -> Iterator[Any]:
    """Start fresh servers (each test needs slots nothing else has filled); stop them after."""
    started: list[LlamaServer] = []

    def start(**kwargs: Any) -> LlamaServer:
        server = LlamaServer(engine_paths, **kwargs).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def _batch(server: LlamaServer, n: int = 4) -> list[Any]:
    return asyncio.run(arun_batch(TASK, inputs(n), model=MODEL, backend=server.llamacpp_url,
                                  system_prompt=SYSTEM, output_schema=Verdict, max_tokens=24,
                                  temperature=0.0, max_retries=0, timeout_per_turn=300))


def test_warm_up_warns_naming_the_flag_when_the_server_defeats_its_cache(
        server_factory: Any, caplog: pytest.LogCaptureFixture) -> None:
    """``--cache-ram 0`` with least-recently-used slots: a repeat of the prefix lands on a slot
    that does not hold it and nothing restores it. agentbatch says so once, naming the flag."""
    server = server_factory(parallel=4, extra_args=("--cache-ram", "0"))
    caplog.set_level(logging.INFO, logger=LOGGER)
    results = _batch(server)
    assert len(results) == 4
    said = _warnings(caplog)
    assert len(said) == 1, said
    assert "--cache-ram 0" in said[0] and "defeats its prompt cache" in said[0]


def test_no_warning_on_a_server_started_normally(
        llama_server: LlamaServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    results = _batch(llama_server)
    assert len(results) == 4
    assert _warnings(caplog) == []


def test_no_warning_on_a_server_started_with_its_own_defaults(
        server_factory: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Slot selection by prompt similarity (llama.cpp's default), 8 slots."""
    server = server_factory(parallel=8, slot_selection=False)
    caplog.set_level(logging.INFO, logger=LOGGER)
    assert len(_batch(server)) == 4
    assert _warnings(caplog) == []


async def _probe_then_turns(url: str, n: int) -> tuple[CacheProbe | None,
                                                        list[dict[str, Any]]]:
    """The warm-up probe, then ``n`` turns at once; every request body agentbatch built."""
    backend = LlamaCppBackend(url)
    sent: list[dict[str, Any]] = []
    build = backend.build_body

    def recording(request: ModelRequest) -> dict[str, Any]:
        body = build(request)
        sent.append(body)
        return body

    backend.build_body = recording  # type: ignore[method-assign]
    try:
        prefix = [{"role": "system", "content": SYSTEM}]
        probe = await backend.probe_cache(ModelRequest(
            model=MODEL, messages=[*prefix, {"role": "user", "content": "ok"}],
            max_tokens=1, agent_key="b:warmup"))
        turns = [ModelRequest(model=MODEL, max_tokens=4, agent_key=f"b:{i}",
                              messages=[*prefix, {"role": "user", "content": f"hi {i}"}])
                 for i in range(n)]
        await asyncio.gather(*(backend.complete(t) for t in turns))
    finally:
        await backend.aclose()
    return probe, [b for b in sent if b["max_tokens"] == 4]


def test_turns_carry_id_slot_of_a_free_slot_when_the_probe_says_pinning_keeps_the_prefix(
        server_factory: Any) -> None:
    """On a server with llama.cpp's default slot selection, the probe finds that a slot keeps
    the prefix while another works, so every turn is sent with ``id_slot``; turns in flight
    at once never share a slot (none waits for a slot one of ours holds)."""
    server = server_factory(parallel=4, slot_selection=False)
    probe, turns = asyncio.run(_probe_then_turns(server.llamacpp_url, 4))
    assert probe is not None and probe.pinning_keeps_prefix and not probe.defeated, probe
    assert sorted(b["id_slot"] for b in turns) == [0, 1, 2, 3]


def test_turns_go_unpinned_where_idle_slots_are_cleared(server_factory: Any) -> None:
    """``-kvu`` (llama.cpp's default when ``-np`` is not given) saves and clears idle slots at
    each new task, so a turn pinned to a cleared slot would compute the prefix again: the
    probe sees that and agentbatch sends no ``id_slot``."""
    server = server_factory(parallel=4, slot_selection=False, extra_args=("-kvu",))
    probe, turns = asyncio.run(_probe_then_turns(server.llamacpp_url, 4))
    assert probe is not None and not probe.pinning_keeps_prefix, probe
    assert len(turns) == 4 and not any("id_slot" in b for b in turns)


def test_without_a_probe_turns_go_unpinned(llama_server: LlamaServer) -> None:
    """No warm-up (a worker, or ``warm_prefix=False``): the server picks the slot."""
    async def run() -> dict[str, Any]:
        backend = LlamaCppBackend(llama_server.llamacpp_url)
        try:
            await backend.props()
            return backend.build_body(ModelRequest(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], agent_key="b:0"))
        finally:
            await backend.aclose()

    body = asyncio.run(run())
    assert "id_slot" not in body and body["cache_prompt"] is True


# -- the pieces, without a server -------------------------------------------------------------


def test_slot_picker_pins_only_where_the_agents_conversation_is() -> None:
    """First turns go to free slots no agent's conversation is in; a later turn to its agent's
    slot while that slot still holds its conversation; else unpinned (the server restores the
    conversation from host memory), counted on the server's likely pick while it runs."""
    picker = SlotPicker(2)
    a, b = picker.acquire("b:0"), picker.acquire("b:1")
    assert (a.send, b.send) == (0, 1)
    picker.release(a, "b:0")
    assert picker.acquire("b:2") == Placement(None, 0)  # slot 0 holds b:0's conversation
    picker.release(Placement(None, 0), "b:2", landed=0)  # the server said: slot 0
    picker.release(b, "b:1")
    assert picker.acquire("b:1") == Placement(1, 1)  # its conversation is still in slot 1
    picker.release(Placement(1, 1), "b:1")
    assert picker.holds == ["b:2", "b:1"]
    assert picker.acquire("b:0") == Placement(None, 0)  # b:2 took its slot
    assert picker.acquire("b:2") == Placement(None, 1)  # b:0 is expected on slot 0
    assert picker.acquire("b:3") == Placement(None, None)  # every slot taken


def test_cache_defeating_flags_are_named_from_the_command_line() -> None:
    assert cache_defeating_flags(["-np", "4", "--slot-prompt-similarity", "0",
                                  "--cache-ram", "0"]) == [
        "--cache-ram 0 with --slot-prompt-similarity 0"]
    assert cache_defeating_flags(["--no-cache-prompt"]) == [
        "--no-cache-prompt (for requests without cache_prompt)"]
    assert cache_defeating_flags(["-np", "8", "--cache-ram", "4096"]) == []
    # similarity selection sends a repeat to the slot holding it: no host cache needed
    assert cache_defeating_flags(["-np", "8", "--cache-ram", "0"]) == []
