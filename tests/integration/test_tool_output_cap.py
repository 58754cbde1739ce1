"""A tool's output is capped (``max_tool_output_chars``) where the tool pool produces it.

A tool that returned 100 MB was stored whole in Redis (~450 MB peak) and then sent to the
model, which answered HTTP 413. The pool now cuts every output to the batch's cap (or the
tool's own ``max_output_chars``) with a marker the model can read, before the output is stored
or sent, on both engines. Checked here with a 3 MB output: in the embedded agent's
conversation, in the prompt the simulator received, and in every value in Redis.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
import redis

from agentbatch import submit_batch, tool
from agentbatch.core.errors import BatchSpecError
from agentbatch.sim.server import SimServer

BIG = 3 * 1024 * 1024
MARKER = "by agentbatch]"
TASK = 'Agent {i}.\n@sim tool big {{"n": {i}}}'
IMPORTS = {"AGENTBATCH_WORKER_IMPORTS": "tests.support,tests.integration.test_tool_output_cap"}


@tool
async def big(n: int) -> str:
    """A tool whose output is far too long for a prompt.

    Args:
        n: anything.
    """
    return f"start-{n}-" + "x" * BIG


@tool(max_output_chars=1000)
async def big_own_cap(n: int) -> str:
    """The same output, with the tool's own, smaller cap.

    Args:
        n: anything.
    """
    return "y" * BIG


@tool
async def hold(flag: str) -> str:
    """Wait until the test has looked at Redis (the file ``flag`` exists; 120 s at most).

    Args:
        flag: a file path.
    """
    deadline = time.monotonic() + 120
    while not os.path.exists(flag) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return "released"


def _values(client: redis.Redis) -> list[bytes]:
    """Every value in Redis (strings, lists, hashes, streams)."""
    values: list[bytes] = []
    for key in client.scan_iter(count=1000):
        kind = client.type(key).decode()
        if kind == "string":
            values.append(client.get(key) or b"")
        elif kind == "list":
            values.extend(client.lrange(key, 0, -1))
        elif kind == "hash":
            values.extend(client.hvals(key))
        elif kind == "stream":
            values.extend(v for _, fields in client.xrange(key) for v in fields.values())
    return values


def _tool_messages(handle) -> list[str]:
    return [m["content"] for s in handle.engine.states.values() for m in s.messages
            if m.get("role") == "tool"]


def test_embedded_tool_output_is_capped_with_a_marker(sim: SimServer, sim_url: str) -> None:
    handle = submit_batch(TASK, [{"i": i} for i in range(2)], tools=[big], model="m",
                          backend=sim_url, max_tool_output_chars=10_000)
    results = handle.wait(timeout=120)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    outputs = _tool_messages(handle)
    assert len(outputs) == 2
    for text in outputs:
        assert len(text) <= 10_000 and text.startswith("start-")
        assert text.endswith(MARKER) and f"of {BIG + len('start-0-')} chars" in text
    # what went over HTTP: two small prompts per agent, not 3 MB each
    assert sim.state.stats.prompt_tokens < 50_000


def test_the_default_cap_and_a_tool_override(sim: SimServer, sim_url: str) -> None:
    handle = submit_batch('Agent {i}.\n@sim tool big {{"n": {i}}}\n@sim tool big_own_cap '
                          '{{"n": {i}}}', [{"i": 0}], tools=[big, big_own_cap], model="m",
                          backend=sim_url)
    assert all(r.ok for r in handle.wait(timeout=120))
    default, own = _tool_messages(handle)
    assert 60_000 < len(default) <= 65_536 and default.endswith(MARKER)
    assert len(own) <= 1000 and own.startswith("y") and own.endswith(MARKER)


@pytest.mark.parametrize("bad", [0, -5, 1.5, "64k", True])
def test_a_bad_cap_is_refused_naming_the_option(sim_url: str, bad: object) -> None:
    with pytest.raises(BatchSpecError, match="max_tool_output_chars"):
        submit_batch("x {i}", [{"i": 1}], tools=[big], model="m", backend=sim_url,
                     max_tool_output_chars=bad)


def test_a_bad_tool_cap_is_refused_naming_it() -> None:
    with pytest.raises(BatchSpecError, match="max_output_chars"):
        tool(max_output_chars=0)(big.fn)


def test_distributed_tool_output_is_capped_before_redis(redis_url: str, start_workers,
                                                        tmp_path: Path) -> None:
    """Each agent's conversation lives in Redis until it ends, so the agents wait in a second
    tool (``hold``) while the test reads every value Redis holds."""
    start_workers(1, concurrency=4, env=IMPORTS)
    flag = tmp_path / "release"
    task = TASK + f'\n@sim tool hold {{{{"flag": "{flag}"}}}}'
    client = redis.from_url(redis_url)
    with SimServer() as sim:
        url = "sim://" + sim.url.split("://", 1)[1]
        handle = submit_batch(task, [{"i": i} for i in range(2)], tools=[big, hold], model="m",
                              backend=url, redis_url=redis_url, max_tool_output_chars=10_000,
                              timeout_per_tool=180)
        try:
            deadline = time.monotonic() + 120
            while True:
                values = _values(client)
                marked = sum(MARKER.encode() in v for v in values)
                if marked >= 2 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        finally:
            flag.touch()
        results = handle.wait(timeout=180)
        prompt_tokens = sim.state.stats.prompt_tokens
    assert marked >= 2, "each agent's stored tool message carries the marker"
    assert max(len(v) for v in values) < 100_000  # nothing near the 3 MB output was stored
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    assert [c.name for r in results for c in r.tool_calls] == ["big", "hold"] * 2
    assert prompt_tokens < 50_000
