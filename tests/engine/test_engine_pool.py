"""Faults in a pool of two real llama-servers (issue 26 item 3): one SIGKILLed mid-batch.

The simulator tests (tests/integration/test_pool_faults.py) show the routing decisions against
processes that answer instantly; these show them against llama.cpp itself, whose connection
refusal, ``/health`` and restart are the real ones. Agents wait in a ``hold`` tool (an
in-process gate: the embedded engine runs tools in this process) while the test kills one
server, so the kill lands between two turns of every agent. Assertions are agentbatch's
decisions (ejection, moves counted, re-admission, every agent has a result, no hang), never
what the model wrote or which server a turn ran on.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal, get_args

import pytest
from pydantic import BaseModel, Field

from agentbatch import submit_batch, tool
from agentbatch.core.results import ErrorKind
from agentbatch.core.tool_context import ToolContext
from agentbatch.engine import EnginePaths, LlamaServer
from tests.support.engine_pool import pick_batch as support_pick_batch
from tests.support.engine_pool import server_pair
from tests.support.waits import wait_until as support_wait_until

pytestmark = pytest.mark.engine

AGENTS = 5
WAIT_S = 600.0  # generous bounds on a loaded 2-core machine: a gate never waits forever
ERROR_KINDS = set(get_args(ErrorKind))  # a structured error: one of the declared kinds


class Note(BaseModel):
    note: str = Field(max_length=30)


class _Gates:
    """Two gates the ``hold`` tool waits on: agent ``late`` waits for ``second``, the others
    for ``first``; ``arrived`` is the agents that have reached the tool."""

    def __init__(self) -> None:
        self.first = threading.Event()
        self.second = threading.Event()
        self.late = -1
        self.arrived: set[int] = set()

    def reset(self, late: int) -> None:
        self.__init__()  # type: ignore[misc]
        self.late = late


GATES = _Gates()


@tool
async def hold(step: Literal["ready"], ctx: ToolContext) -> str:
    """Wait for the go-ahead.

    Args:
        step: always "ready".
    """
    GATES.arrived.add(ctx.agent_index)
    gate = GATES.second if ctx.agent_index == GATES.late else GATES.first
    deadline = time.monotonic() + WAIT_S
    while not gate.is_set():
        if time.monotonic() > deadline:
            raise RuntimeError("the test never opened the gate")
        await asyncio.sleep(0.05)
    return "go"


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    support_wait_until(predicate, what, timeout, poll_s=0.1)


def pick_batch(urls: list[str], b_url: str) -> tuple[str, list[int], list[int]]:
    return support_pick_batch(urls, b_url, AGENTS, "enginepool")


@pytest.fixture
def servers(engine_paths: EnginePaths) -> Iterator[list[LlamaServer]]:
    with server_pair(engine_paths) as pair:
        yield pair


def endpoint(stats: dict[str, Any], server: LlamaServer) -> dict[str, Any]:
    pool = stats["pool"]
    return next(v for k, v in pool["endpoints"].items() if k.endswith(f":{server.port}"))


def test_killed_server_is_ejected_its_agents_move_counted_and_it_comes_back(
        engine_paths: EnginePaths, servers: list[LlamaServer]) -> None:
    """SIGKILL one of two llama-servers between two turns of every agent: it is ejected,
    the turns of the agents whose home it was move (counted as failover), every agent ends
    with a result, and the server restarted on its port is re-admitted by the pool's probe."""
    a, b = servers
    urls = [a.llamacpp_url, b.llamacpp_url]
    batch_id, on_a, on_b = pick_batch(urls, b.llamacpp_url)
    GATES.reset(late=on_a[0])  # agent ``late`` keeps the batch open until B is back
    handle = submit_batch(
        "Ticket {i}: call the hold tool, then write a short note.",
        [{"i": i} for i in range(AGENTS)], model="smollm2", backend=urls, batch_id=batch_id,
        output_schema=Note, tools=[hold], tool_calling="json", tool_choice="required",
        max_turns=3, max_retries=1, max_tokens=48, temperature=0.0, timeout_per_turn=300)
    try:
        wait_until(lambda: len(GATES.arrived) == AGENTS, "every agent in its tool call")
        assert b.proc is not None
        os.kill(b.proc.pid, signal.SIGKILL)  # mid-batch: B's agents have turns to run
        b.proc.wait(30)
        GATES.first.set()

        def moved() -> bool:
            ep, moves = endpoint(handle.stats(), b), handle.stats()["pool"]["moves"]
            return bool(ep["ejected"]) and moves["failover"] >= 1

        wait_until(moved, "B ejected and its agents' turns moved")
        stats = handle.stats()
        assert endpoint(stats, b)["ejections"] == 1
        assert not endpoint(stats, a)["ejected"]
        print(f"after the kill: {stats['pool']}; homes A {on_a} B {on_b}")

        b.stop()  # reap the killed process; the same port again
        b.start()
        wait_until(lambda: not endpoint(handle.stats(), b)["ejected"],
                   "re-admission of the restarted server")
        GATES.second.set()
        results = handle.wait(timeout=WAIT_S)  # bounded: never hangs
    finally:
        GATES.first.set()
        GATES.second.set()
    assert sorted(r.index for r in results) == list(range(AGENTS))
    for r in results:  # every agent ended: ok, or a structured error (not the model's quality)
        assert r.ok or (r.error is not None and r.error.kind in ERROR_KINDS), r.error
    final = handle.stats()["pool"]
    print(f"final: {final}; results {[(r.ok, r.error and r.error.kind) for r in results]}")
    assert final["moves"]["failover"] >= 1
    assert endpoint(handle.stats(), b)["ejections"] == 1  # re-admitted, not ejected again
