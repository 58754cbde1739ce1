"""``pool_routing`` over real HTTP on a pool of two simulators, on both engines.

One agent takes four model turns (three tool rounds, then its answer), one at a time, so no
turn is in flight when the next is routed: with ``"affinity"`` (the default) every turn goes
to the agent's home server; with ``"least_outstanding"`` the pool has no home for it and its
ties take turns, so the four turns alternate between the servers. The simulators count chat
requests per agent (``/sim/stats`` ``chat_by_agent``): the assertions are about which server
agentbatch sent each turn to, never about timings.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from agentbatch import submit_batch
from agentbatch.sim import SimConfig, SimServer
from tests.support.tools import Answer, pad

TURNS = 4
TASK = ('Agent {i}.\n@sim tool pad {{"n": 1}}\n@sim tool pad {{"n": 2}}\n'
        '@sim tool pad {{"n": 3}}')
IMPORTS = {"AGENTBATCH_WORKER_IMPORTS": "tests.support"}


def turns_per_server(servers: list[SimServer]) -> list[int]:
    """Each server's chat requests for the batch's one agent."""
    served = []
    for server in servers:
        with urllib.request.urlopen(server.url + "/sim/stats", timeout=30) as resp:
            by_agent: dict[str, int] = json.loads(resp.read())["chat_by_agent"]
        assert len(by_agent) <= 1, by_agent
        served.append(sum(by_agent.values()))
    return served


@pytest.fixture
def two_sims() -> Iterator[list[SimServer]]:
    with SimServer(SimConfig(fixed_ms=5)) as a, SimServer(SimConfig(fixed_ms=5)) as b:
        yield [a, b]


def _run(servers: list[SimServer], redis_url: str | None, **options: Any) -> dict[str, Any]:
    handle = submit_batch(TASK, [{"i": 0}], model="sim-model", output_schema=Answer,
                          tools=[pad], backend=[s.url for s in servers], redis_url=redis_url,
                          **options)
    results = handle.wait(timeout=120)
    assert all(r.ok and r.turns == TURNS for r in results), [r.error for r in results]
    return handle.stats() if redis_url is None else {}


@pytest.mark.parametrize(("routing", "served"),
                         [(None, [[TURNS, 0], [0, TURNS]]),
                          ("least_outstanding", [[2, 2]])])
def test_embedded_routing_decides_where_each_turn_goes(
        two_sims: list[SimServer], routing: str | None, served: list[list[int]]) -> None:
    options = {} if routing is None else {"pool_routing": routing}
    stats = _run(two_sims, None, **options)
    assert turns_per_server(two_sims) in served
    requests = [ep["requests"] for ep in stats["pool"]["endpoints"].values()]
    assert requests in served  # the pool's own count of what it sent where
    assert stats["pool"]["moves"] == {"load": 0, "failover": 0}


@pytest.mark.redis
@pytest.mark.slow
def test_distributed_workers_route_by_the_plans_routing(
        redis_url: str, start_workers: Any, two_sims: list[SimServer]) -> None:
    # one worker: its pool routes every turn of the agent, in order
    start_workers(1, concurrency=2, env=IMPORTS)
    _run(two_sims, redis_url)
    assert sorted(turns_per_server(two_sims)) == [0, TURNS]
    for server in two_sims:
        with urllib.request.urlopen(server.url + "/sim/reset", data=b"", timeout=30):
            pass
    _run(two_sims, redis_url, pool_routing="least_outstanding")
    assert turns_per_server(two_sims) == [2, 2]
