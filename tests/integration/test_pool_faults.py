"""Faults in a pool of two simulator processes, on both engines: one SIGKILLed mid-batch, one
SIGSTOPped, both killed. Real processes, so the signals are real.

Agents wait in a ``hold`` tool (a file gate) while the test signals a server, so the fault
lands between two turns of every agent. Assertions are outcomes and counts: which agents'
turns each simulator served (``/sim/stats`` ``chat_by_agent``), the pool's own counters
(``handle.stats()["pool"]``), and every result's kind; never timings.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agentbatch import submit_batch, tool
from agentbatch.core.errors import BackendUnavailable
from agentbatch.sim import SimConfig
from agentbatch.sim.process import SimProcess, free_port
from tests.support.tools import Answer

AGENTS = 12
HOLD_LIMIT_S = 120.0  # a gate that never opens fails the tool, it does not hang the test


@tool
async def hold(gate: str) -> str:
    """Wait until the file ``gate`` exists; each call first leaves a mark next to it.

    Args:
        gate: path of the file to wait for.
    """
    Path(f"{gate}.arrived.{uuid.uuid4().hex}").touch()
    deadline = time.monotonic() + HOLD_LIMIT_S
    while not os.path.exists(gate):
        if time.monotonic() > deadline:
            raise RuntimeError(f"gate {gate} never opened")
        await asyncio.sleep(0.05)
    return "go"


def task(tmp: Path, gates: int) -> str:
    calls = "\n".join(f'@sim tool hold {{{{"gate": "{tmp}/g{n}"}}}}' for n in range(gates))
    return "Agent {i}.\n" + calls


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.05)


def arrived(tmp: Path, gate: int) -> int:
    return len(list(tmp.glob(f"g{gate}.arrived.*")))


def open_gate(tmp: Path, gate: int) -> None:
    (tmp / f"g{gate}").touch()


def by_agent(sim: SimProcess) -> dict[str, int]:
    with urllib.request.urlopen(sim.url + "/sim/stats", timeout=30) as resp:
        return dict(json.loads(resp.read())["chat_by_agent"])


@pytest.fixture
def sims() -> Iterator[list[SimProcess]]:
    procs = [SimProcess(SimConfig(fixed_ms=5, port=free_port())) for _ in range(2)]
    for p in procs:
        p.start()
    yield procs
    for p in procs:
        if p.proc is not None and p.proc.poll() is None:
            os.kill(p.proc.pid, signal.SIGCONT)  # a stopped child cannot handle SIGTERM
        p.stop()


# Workers import tools only from listed modules: this one holds ``hold``.
WORKER_ENV = {"AGENTBATCH_WORKER_IMPORTS":
              "tests.support,tests.integration.test_pool_faults,agentbatch.toolpool.builtins"}


def kill(sim: SimProcess) -> None:
    assert sim.proc is not None
    sim.proc.kill()
    sim.proc.wait(30)


def restart(sim: SimProcess) -> None:
    sim.stop()  # reaps the killed process; the config keeps the same port
    sim.start()


def submit(tmp: Path, sims: list[SimProcess], gates: int, **kw: Any) -> Any:
    return submit_batch(task(tmp, gates), [{"i": i} for i in range(AGENTS)], model="sim-model",
                        output_schema=Answer, tools=[hold], backend=[s.url for s in sims], **kw)


def homed_on(sim: SimProcess, other: SimProcess) -> set[str]:
    """Agents served by ``sim`` alone so far (the warm-up request reached both)."""
    return set(by_agent(sim)) - set(by_agent(other))


def test_embedded_killed_server_is_ejected_its_agents_move_and_it_comes_back(
        tmp_path: Path, sims: list[SimProcess]) -> None:
    a, b = sims
    handle = submit(tmp_path, sims, gates=2, timeout_per_turn=60)
    wait_until(lambda: arrived(tmp_path, 0) == AGENTS, "every agent in its first tool call")
    on_b = homed_on(b, a)  # one turn each so far: these agents' home is B
    assert on_b and len(on_b) < AGENTS
    kill(b)  # mid-batch: B's agents have their next turns to run
    open_gate(tmp_path, 0)
    wait_until(lambda: arrived(tmp_path, 1) == AGENTS, "every agent past the killed server")
    pool = handle.stats()["pool"]
    name_b = next(n for n in pool["endpoints"] if str(b.config.port) in n)
    assert pool["endpoints"][name_b]["ejected"] and pool["endpoints"][name_b]["ejections"] == 1
    assert on_b <= set(by_agent(a))  # B's agents' second turns ran on A ...
    moves = pool["moves"]  # ... each counted as a move (off a dead home, or a busy one)
    assert moves["failover"] >= 1 and moves["failover"] + moves["load"] >= len(on_b), moves

    restart(b)  # back on the same port (a new process: its counts start at 0)
    wait_until(lambda: not handle.stats()["pool"]["endpoints"][name_b]["ejected"],
               "re-admission of the restarted server")
    load_before = handle.stats()["pool"]["moves"]["load"]
    open_gate(tmp_path, 1)
    results = handle.wait(timeout=120)
    assert all(r.ok and r.turns == 3 for r in results), [r.error for r in results if not r.ok]
    # Re-admitted, B takes turns again, but every agent's conversation is on A now (B's
    # agents' second turns ran there): an agent's last turn goes to B only as a move off a
    # busy A, each counted as load.
    assert handle.stats()["pool"]["endpoints"][name_b]["ejections"] == 1
    served_by_b = set(by_agent(b))
    loaded = handle.stats()["pool"]["moves"]["load"] - load_before
    assert len(served_by_b) <= loaded, (served_by_b, loaded)


def test_embedded_stopped_server_does_not_hold_the_tail(
        tmp_path: Path, sims: list[SimProcess]) -> None:
    a, b = sims
    handle = submit(tmp_path, sims, gates=1, timeout_per_turn=60)
    wait_until(lambda: arrived(tmp_path, 0) == AGENTS, "every agent in its tool call")
    on_b = homed_on(b, a)
    assert on_b and len(on_b) < AGENTS
    assert b.proc is not None
    os.kill(b.proc.pid, signal.SIGSTOP)  # B accepts connections and never answers
    try:
        open_gate(tmp_path, 0)
        results = handle.wait(timeout=120)
    finally:
        os.kill(b.proc.pid, signal.SIGCONT)
    assert all(r.ok and r.turns == 2 for r in results), [r.error for r in results if not r.ok]
    assert on_b <= set(by_agent(a))  # the turns stuck on B were answered by A
    pool = handle.stats()["pool"]
    name_b = next(n for n in pool["endpoints"] if str(b.config.port) in n)
    assert pool["endpoints"][name_b]["ejections"] == 1
    moves = pool["moves"]
    assert moves["failover"] >= 1 and moves["failover"] + moves["load"] >= len(on_b), moves


def test_embedded_every_server_down_ends_each_agent_backend_unavailable(
        tmp_path: Path, sims: list[SimProcess]) -> None:
    handle = submit(tmp_path, sims, gates=1, timeout_per_turn=30)
    wait_until(lambda: arrived(tmp_path, 0) == AGENTS, "every agent in its tool call")
    for sim in sims:
        kill(sim)
    open_gate(tmp_path, 0)
    results = handle.wait(timeout=120)  # bounded: never hangs
    assert len(results) == AGENTS
    assert {r.error.kind for r in results if r.error} == {"backend_unavailable"}
    assert not any(r.ok for r in results)


def test_every_server_down_at_submit_is_refused_naming_backend() -> None:
    urls = [f"vllm://127.0.0.1:{free_port()}", f"vllm://127.0.0.1:{free_port()}"]
    with pytest.raises(BackendUnavailable, match=r"backend vllm://127\.0\.0\.1:\d+, vllm://"):
        submit_batch("Agent {i}.", [{"i": i} for i in range(3)], model="m", backend=urls,
                     timeout_per_turn=10)


@pytest.mark.redis
@pytest.mark.slow
def test_distributed_killed_server_its_agents_move_and_it_comes_back(
        tmp_path: Path, sims: list[SimProcess], redis_url: str, start_workers: Any) -> None:
    a, b = sims
    start_workers(2, concurrency=8, env=WORKER_ENV)
    handle = submit(tmp_path, sims, gates=2, timeout_per_turn=60, redis_url=redis_url)
    wait_until(lambda: arrived(tmp_path, 0) == AGENTS, "every agent in its first tool call")
    on_b = homed_on(b, a)
    assert on_b and len(on_b) < AGENTS
    kill(b)
    open_gate(tmp_path, 0)
    wait_until(lambda: arrived(tmp_path, 1) == AGENTS, "every agent past the killed server")
    assert on_b <= set(by_agent(a))  # whichever worker ran them, B's agents moved to A
    restart(b)
    # Each worker's pool re-admits B on its own probe; agents stay where their conversation
    # is (A) unless A is busy. Held turns wait at gate 1 until B answers its health check.
    open_gate(tmp_path, 1)
    results = handle.wait(timeout=180)
    assert all(r.ok and r.turns == 3 for r in results), [r.error for r in results if not r.ok]


@pytest.mark.redis
@pytest.mark.slow
def test_distributed_every_server_down_ends_each_agent_backend_unavailable(
        tmp_path: Path, sims: list[SimProcess], redis_url: str, start_workers: Any) -> None:
    start_workers(2, concurrency=8, env=WORKER_ENV)
    handle = submit(tmp_path, sims, gates=1, timeout_per_turn=30, redis_url=redis_url)
    wait_until(lambda: arrived(tmp_path, 0) == AGENTS, "every agent in its tool call")
    for sim in sims:
        kill(sim)
    open_gate(tmp_path, 0)
    results = handle.wait(timeout=180)  # bounded: never hangs
    assert len(results) == AGENTS
    assert {r.error.kind for r in results if r.error} == {"backend_unavailable"}
