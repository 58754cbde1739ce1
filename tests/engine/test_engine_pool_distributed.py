"""Faults in a pool of two real llama-servers on the distributed engine (issue 26 item 3).

The embedded test (``test_engine_pool.py``) reads the pool's counters from the handle; on the
distributed engine each worker process routes with its own ``EndpointPool`` (affinity by
agent key, so every worker picks the same home), and what it decides is in its log: the
ejection (``endpoint ... ejected``), each turn moved off its home (``failover: ...``) and the
re-admission; the moves also reach the batch's status (``stat:pool_moves_failover``).
Agents wait in ``pool_gate.hold_gate`` (a file gate the worker processes share) while the
test SIGKILLs one server, so the kill lands between two turns of every agent. Assertions are
agentbatch's decisions and that every agent has a result (ok, or a structured error), never
what the model wrote; no timing asserts; every wait has a deadline.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, get_args

import pytest

from agentbatch import submit_batch
from agentbatch.core.results import ErrorKind
from agentbatch.engine import EnginePaths, LlamaServer
from tests.engine.pool_gate import GATE_ENV, Note, hold_gate
from tests.support.engine_pool import pick_batch as support_pick_batch
from tests.support.engine_pool import server_pair
from tests.support.scratch import scratch_dir
from tests.support.waits import wait_until as support_wait_until

pytestmark = [pytest.mark.engine, pytest.mark.redis]

AGENTS = 5
WAIT_S = 600.0  # generous bounds on a loaded 2-core machine
ERROR_KINDS = set(get_args(ErrorKind))


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    support_wait_until(predicate, what, timeout, poll_s=0.2)


def pick_batch(urls: list[str], b_url: str) -> tuple[str, list[int], list[int]]:
    return support_pick_batch(urls, b_url, AGENTS, "enginepooldist")


@pytest.fixture
def servers(engine_paths: EnginePaths) -> Iterator[list[LlamaServer]]:
    with server_pair(engine_paths) as pair:
        yield pair


@pytest.fixture
def gate() -> Path:
    return scratch_dir("pool-gate-")


@pytest.mark.timeout(900)  # two servers, two workers, a restart: minutes on a loaded machine
def test_killed_server_distributed_ejected_moved_readmitted(
        engine_paths: EnginePaths, servers: list[LlamaServer], gate: Path,
        start_workers: Any) -> None:
    """Two worker processes, a pool of two llama-servers, B SIGKILLed while every agent is in
    a tool call: a worker ejects B, the turns of B's agents move to A (logged as failover),
    B restarted on its port is re-admitted, and every agent ends with a result."""
    a, b = servers
    urls = [a.llamacpp_url, b.llamacpp_url]
    batch_id, on_a, on_b = pick_batch(urls, b.llamacpp_url)
    late = on_a[0]  # keeps the batch open until B is back
    (gate / "late").write_text(str(late))
    workers = start_workers(2, concurrency=8, env={
        "AGENTBATCH_WORKER_IMPORTS": "tests.support,tests.engine.pool_gate",
        GATE_ENV: str(gate)})

    def logs() -> str:
        return "\n".join(w.log() for w in workers)

    handle = submit_batch(
        "Ticket {i}: call the hold_gate tool, then write a short note.",
        [{"i": i} for i in range(AGENTS)], model="smollm2", backend=urls, batch_id=batch_id,
        output_schema=Note, tools=[hold_gate], tool_calling="json", tool_choice="required",
        max_turns=3, max_retries=2, max_tokens=48, temperature=0.0, timeout_per_turn=300,
        redis_url=workers[0].redis_url)
    try:
        wait_until(lambda: len(list(gate.glob("arrived-*"))) == AGENTS,
                   "every agent in its tool call")
        assert b.proc is not None
        os.kill(b.proc.pid, signal.SIGKILL)  # mid-batch: B's agents have turns to run
        b.proc.wait(30)
        (gate / "go").touch()

        ejected = f"endpoint {b.llamacpp_url} ejected"
        moved = f"moved off {b.llamacpp_url} to {a.llamacpp_url}"
        wait_until(lambda: ejected in logs() and moved in logs(),
                   "B ejected by a worker and a turn of B's agents moved to A")
        # the workers' moves reach the batch's status (their stats flush is in the background)
        wait_until(lambda: handle.status().get("stat:pool_moves_failover", 0) >= 1,
                   "the failover counted on the batch")
        assert f"endpoint {a.llamacpp_url} ejected" not in logs()
        ejecting = [w for w in workers if ejected in w.log()]

        b.stop()  # reap the killed process; the same port again
        b.start()
        readmitted = f"endpoint {b.llamacpp_url} re-admitted"
        wait_until(lambda: all(readmitted in w.log() for w in ejecting),
                   "re-admission of the restarted server by every worker that ejected it")
        (gate / "go-late").touch()
        results = handle.wait(timeout=WAIT_S)  # bounded: never hangs
    finally:
        (gate / "go").touch()
        (gate / "go-late").touch()
    text = logs()
    status = handle.status()
    print(f"homes A {on_a} B {on_b}; ejections {text.count(ejected)}; "
          f"failover moves logged {text.count(moved)}; "
          f"moves on the batch {[(k, v) for k, v in status.items() if 'pool_moves' in k]}; "
          f"results {[(r.index, r.ok, r.error and r.error.kind) for r in results]}")
    assert sorted(r.index for r in results) == list(range(AGENTS))
    for r in results:  # every agent ended: ok, or a structured error (not the model's quality)
        assert r.ok or (r.error is not None and r.error.kind in ERROR_KINDS), r.error
    # each worker ejected B at most once: re-admitted, not ejected again
    assert all(w.log().count(ejected) == 1 for w in ejecting)
