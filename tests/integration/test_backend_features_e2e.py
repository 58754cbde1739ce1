"""Backend features through submit_batch: pools, hostfiles, batch prompting, backpressure."""

from __future__ import annotations

import threading

from agentbatch import run_batch, submit_batch, tool
from agentbatch.sim.config import SimConfig
from agentbatch.sim.process import SimProcess
from agentbatch.sim.server import SimServer


@tool
async def pause(key: str) -> str:
    """Wait a little, like a slow external call.

    Args:
        key: anything.
    """
    import asyncio

    await asyncio.sleep(0.3)
    return key


def _sim_url(url: str) -> str:
    return "sim://" + url.split("://", 1)[1]


def test_pool_of_two_with_one_killed_mid_batch_still_ends_every_agent_ok():
    with SimProcess(SimConfig(fixed_ms=20)) as a, SimProcess(SimConfig(fixed_ms=20)) as b:
        task = ('Agent {i}.\n@sim tool pause {{"key": "a{i}"}}\n'
                '@sim tool pause {{"key": "b{i}"}}\n@sim tool pause {{"key": "c{i}"}}')
        handle = submit_batch(task, [{"i": i} for i in range(60)], tools=[pause], model="m",
                              backend=[_sim_url(a.url), _sim_url(b.url)], max_turns=5,
                              timeout_per_turn=2.0, max_retries=3)
        killer = threading.Timer(0.5, b.stop)
        killer.start()
        results = handle.wait(timeout=120)
        killer.join()
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    assert all(r.turns == 4 for r in results)


def test_hostfile_backend(tmp_path, sim):
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"# the pool\n{sim.url}\n")
    results = run_batch("Agent {i}.", [{"i": i} for i in range(5)], model="m",
                        backend=f"@{hostfile}")
    assert all(r.ok for r in results)


def test_batch_prompting_sends_fewer_requests_and_maps_answers_back(sim, sim_url):
    inputs = [{"i": i} for i in range(40)]
    handle = submit_batch("Question {i}.\n@sim answer reply-{i}\nThanks.", inputs, model="m",
                          backend=sim_url, batch_prompting=True, warm_prefix=False)
    results = handle.wait(timeout=60)
    requests = sim.state.stats.as_dict()["requests"]
    assert [r.output for r in results] == [f"reply-{i}" for i in range(40)]
    assert requests.get("completions", 0) >= 1
    assert sum(requests.values()) < 40
    assert handle.stats()["requests_sent"] < 40


def test_backpressure_holds_dispatch_while_the_server_queue_is_long():
    with SimServer(SimConfig(max_running=2, decode_ms=20)) as sim:
        # later turns arrive while the queue from the first burst is still long
        task = 'Agent {i}.\n@sim tool pause {{"key": "{i}"}}\n@sim tool pause {{"key": "x{i}"}}'
        handle = submit_batch(task, [{"i": i} for i in range(24)], model="m", tools=[pause],
                              backend=_sim_url(sim.url), max_server_waiting=2,
                              warm_prefix=False, max_turns=4)
        results = handle.wait(timeout=120)
        stats = sim.state.stats.as_dict()
    gate = handle.engine.gate
    assert all(r.ok for r in results)
    assert gate.stats()["holds"] > 0  # it did hold dispatch
    assert stats["max_waiting_seen"] <= 24
    assert gate.stats()["fetches"] > 1


def test_streaming_backend_reports_ttft(sim):
    """Each result carries the TTFT of its agent's first streamed turn; unstreamed, none."""
    inputs = [{"i": i} for i in range(3)]
    streamed = run_batch("Agent {i}.", inputs, model="m", backend=_sim_url(sim.url) + "?stream=1")
    plain = run_batch("Agent {i}.", inputs, model="m", backend=_sim_url(sim.url))
    assert all(r.ok for r in streamed + plain)
    for r in streamed:
        assert r.ttft_s is not None and 0 < r.ttft_s <= r.latency_s, (r.ttft_s, r.latency_s)
        assert r.to_json_dict()["ttft_s"] == r.ttft_s
    assert [r.ttft_s for r in plain] == [None, None, None]


CACHED_RUNS: list[str] = []


@tool(cacheable=True)
async def cached_pause(key: str) -> str:
    """A cacheable (idempotent) lookup, safe to start before its turn ends.

    Args:
        key: anything.
    """
    import asyncio

    CACHED_RUNS.append(key)
    await asyncio.sleep(0.05)
    return f"v-{key}"


def test_streamed_tool_calls_start_before_the_turn_ends():
    task = 'Agent {i}.\n@sim tools cached_pause {{"key": "a{i}"}} ; cached_pause {{"key": "b{i}"}}'
    with SimServer(SimConfig(max_running=8, decode_ms=5)) as sim:
        handle = submit_batch(task, [{"i": i} for i in range(6)], tools=[cached_pause],
                              model="m", backend=_sim_url(sim.url) + "?stream=1", max_turns=3)
        results = handle.wait(timeout=60)
    assert all(r.ok and len(r.tool_calls) == 2 for r in results)
    # the first call of each agent's parallel pair was announced while the second streamed
    assert handle.engine.early_started >= 6
    assert sorted(CACHED_RUNS) == sorted([f"a{i}" for i in range(6)] + [f"b{i}" for i in range(6)])
