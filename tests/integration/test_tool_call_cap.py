"""max_tool_calls_per_turn end to end: a reply with more calls runs only the first N.

The simulator's ``@sim tools`` directive makes one reply with many calls; it only moves on
to its answer once every call of that reply has a tool message, so a finished agent also
proves the call/result pairing the server saw was complete.
"""

from __future__ import annotations

import threading

import pytest
import redis

from agentbatch import run_batch, submit_batch, tool
from tests.support.tools import Answer, lookup

RAN: list[str] = []
_lock = threading.Lock()


@tool
def note(key: str) -> str:
    """Record that a call ran.

    Args:
        key: which call.
    """
    with _lock:
        RAN.append(key)
    return f"noted {key}"


def _task(tool_name: str, n: int) -> str:
    """A task template whose reply makes ``n`` calls (braces doubled for str.format)."""
    calls = " ; ".join(tool_name + ' {{"key": "k{i}-' + str(j) + '"}}' for j in range(n))
    return "Agent {i}.\n@sim tools " + calls


def _check(results, cap: int, n: int) -> None:
    for r in results:
        assert r.ok, r.error
        assert [c.ok for c in r.tool_calls] == [j < cap for j in range(n)]


def test_embedded_runs_only_the_first_calls_of_a_reply(sim_url):
    RAN.clear()
    results = run_batch(_task("note", 5), [{"i": i} for i in range(3)], tools=[note],
                        model="sim-model", backend=sim_url, max_tool_calls_per_turn=2)
    _check(results, cap=2, n=5)
    assert sorted(RAN) == sorted(f"k{i}-{j}" for i in range(3) for j in range(2))


@pytest.mark.redis
def test_distributed_runs_only_the_first_calls_of_a_reply(redis_url, sim_url, start_workers):
    start_workers(1, concurrency=8, env={"AGENTBATCH_WORKER_IMPORTS": "tests.support"})
    handle = submit_batch(_task("lookup", 5), [{"i": i} for i in range(3)], tools=[lookup],
                          output_schema=Answer, model="sim-model", backend=sim_url,
                          redis_url=redis_url, max_tool_calls_per_turn=2)
    results = handle.wait(timeout=120)
    _check(results, cap=2, n=5)
    r = redis.from_url(redis_url, decode_responses=True)
    ran = sorted(k.removeprefix("test:exec:lookup:") for k in r.scan_iter("test:exec:lookup:*"))
    assert ran == sorted(f"k{i}-{j}" for i in range(3) for j in range(2))
