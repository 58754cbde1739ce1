"""``max_server_waiting`` holds from the first request, over real HTTP against the simulator.

The gauge (``/metrics``) is read at most every 0.5 s, and the first read sees an empty queue,
so a gate trusting the gauge alone let the whole first wave through (40 agents with
``max_running=2``: 38 waiting). The gate also counts what its process has sent since the
reading it holds, so one process adds at most ``max_waiting + 1`` to the server's queue: it
admits a call while ``gauge + unseen <= max_waiting``, i.e. the last one admitted can make it
``max_waiting + 1``. The simulator records the longest queue it ever had
(``max_waiting_seen``), so the test asserts a count, not a time.
"""

from __future__ import annotations

import pytest

from agentbatch import submit_batch
from agentbatch.sim.config import SimConfig
from agentbatch.sim.server import SimServer

# One process's gate: ``max_waiting + 1`` (see the module docstring).
ONE_PROCESS_BOUND = 1


def _sim_url(url: str) -> str:
    return "sim://" + url.split("://", 1)[1]


@pytest.mark.parametrize(("agents", "max_waiting"), [(40, 2), (20, 1)])
def test_the_first_wave_is_held_embedded(agents: int, max_waiting: int) -> None:
    with SimServer(SimConfig(max_running=2, decode_ms=20)) as sim:
        handle = submit_batch("Agent {i}.", [{"i": i} for i in range(agents)], model="m",
                              backend=_sim_url(sim.url), max_server_waiting=max_waiting,
                              warm_prefix=False, max_turns=2, timeout_per_turn=120)
        results = handle.wait(timeout=300)
        stats = sim.state.stats.as_dict()
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    assert stats["requests_total"] >= agents
    assert stats["max_waiting_seen"] <= max_waiting + ONE_PROCESS_BOUND, stats
    assert handle.engine.gate.stats()["holds"] > 0


def test_the_first_wave_is_held_distributed(redis_url: str, start_workers) -> None:
    """One worker process (16 task threads on one loop, one gate): the same bound."""
    start_workers(1, concurrency=16)
    with SimServer(SimConfig(max_running=2, decode_ms=20)) as sim:
        handle = submit_batch("Agent {i}.", [{"i": i} for i in range(40)], model="m",
                              backend=_sim_url(sim.url), redis_url=redis_url,
                              max_server_waiting=2, warm_prefix=False, max_turns=2,
                              timeout_per_turn=120)
        results = handle.wait(timeout=300)
        stats = sim.state.stats.as_dict()
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    assert stats["requests_total"] >= 40
    assert stats["max_waiting_seen"] <= 2 + ONE_PROCESS_BOUND, stats
