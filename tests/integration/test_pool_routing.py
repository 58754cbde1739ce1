"""A pool of two simulators: every turn of an agent lands on one server, on both engines.

The simulators count chat requests per agent (``/sim/stats`` ``chat_by_agent``, keyed by the
sha1 of the agent's first user message), so the assertions are about which server served
which agent's turns, never about timings. On the distributed engine two worker processes
route each agent's turns with no shared state: they agree only because the home endpoint is
a function of the agent's key (rendezvous hashing).
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

AGENTS = 24
TURNS = 4  # three tool rounds, then the answer
TASK = ('Agent {i}.\n@sim tool pad {{"n": 1}}\n@sim tool pad {{"n": 2}}\n'
        '@sim tool pad {{"n": 3}}')


def sim_stats(server: SimServer) -> dict[str, Any]:
    with urllib.request.urlopen(server.url + "/sim/stats", timeout=30) as resp:
        return json.loads(resp.read())


def split_agents(servers: list[SimServer]) -> tuple[int, list[str]]:
    """(agents whose TURNS turns were all counted, agents served by more than one server)."""
    per_server = [sim_stats(s)["chat_by_agent"] for s in servers]
    keys = {k for counts in per_server for k in counts}
    agents = [k for k in keys if sum(c.get(k, 0) for c in per_server) == TURNS]
    split = [k for k in agents if sum(1 for c in per_server if c.get(k)) > 1]
    return len(agents), split


@pytest.fixture
def two_sims() -> Iterator[list[SimServer]]:
    with SimServer(SimConfig(fixed_ms=5)) as a, SimServer(SimConfig(fixed_ms=5)) as b:
        yield [a, b]


def test_embedded_counts_every_turn_that_leaves_its_home(two_sims: list[SimServer]) -> None:
    # All 24 agents in flight at once on the default bound (1.25x the mean): how many turns
    # move depends on timing, so what is asserted is that each agent served by both servers
    # left its home through a counted load move, never a failover.
    handle = submit_batch(TASK, [{"i": i} for i in range(AGENTS)], model="sim-model",
                          output_schema=Answer, tools=[pad],
                          backend=[s.url for s in two_sims])
    results = handle.wait(timeout=120)
    assert all(r.ok and r.turns == TURNS for r in results), [r.error for r in results][:3]
    agents, split = split_agents(two_sims)
    assert agents == AGENTS
    pool = handle.stats()["pool"]
    moves = pool["moves"]
    assert len(split) <= moves["load"] and moves["failover"] == 0, (split, moves)
    served = [s["requests"] for s in pool["endpoints"].values()]
    assert all(n > 0 for n in served), served  # both servers took agents


def test_embedded_keeps_each_agents_turns_on_one_server(two_sims: list[SimServer]) -> None:
    # A bound no endpoint can reach (50x the mean, more than the 24 agents in flight): no
    # turn may move, so every agent's turns must meet on the server its first turn found.
    handle = submit_batch(TASK, [{"i": i} for i in range(AGENTS)], model="sim-model",
                          output_schema=Answer, tools=[pad],
                          backend=[s.url for s in two_sims], pool_load_factor=50)
    results = handle.wait(timeout=120)
    assert all(r.ok and r.turns == TURNS for r in results), [r.error for r in results][:3]
    agents, split = split_agents(two_sims)
    assert agents == AGENTS
    assert split == [], f"{len(split)} of {AGENTS} agents were served by both servers"
    assert handle.stats()["pool"]["moves"] == {"load": 0, "failover": 0}


@pytest.mark.redis
@pytest.mark.slow
def test_two_workers_send_each_agents_turns_to_one_server(
        redis_url: str, start_workers: Any, two_sims: list[SimServer]) -> None:
    # Two in flight per worker at most: below the pool's load bound, so no turn may move and
    # every agent's turns must meet on its home server, whichever worker runs them.
    start_workers(2, concurrency=2)
    handle = submit_batch(TASK, [{"i": i} for i in range(AGENTS)], model="sim-model",
                          output_schema=Answer, tools=[pad],
                          backend=[s.url for s in two_sims], redis_url=redis_url)
    results = handle.wait(timeout=180)
    assert all(r.ok and r.turns == TURNS for r in results), [r.error for r in results][:3]
    agents, split = split_agents(two_sims)
    assert agents == AGENTS
    assert split == [], f"{len(split)} of {AGENTS} agents were served by both servers"
    assert all(sim_stats(s)["requests"].get("chat_completions", 0) > 0 for s in two_sims)


@pytest.mark.redis
@pytest.mark.slow
def test_a_batch_splits_evenly_over_the_pool_whichever_worker_starts_each_agent(
        redis_url: str, start_workers: Any, two_sims: list[SimServer]) -> None:
    # One turn in flight per worker: each worker's own count of turns in flight is 0 at every
    # first turn, so placing by it sent each agent to its hash home (an uneven split in about
    # three batches of four). Spread by the agent's number, 8 agents start 4 and 4, and stay.
    start_workers(2, concurrency=1)
    agents = 8
    handle = submit_batch(TASK, [{"i": i} for i in range(agents)], model="sim-model",
                          output_schema=Answer, tools=[pad],
                          backend=[s.url for s in two_sims], redis_url=redis_url)
    results = handle.wait(timeout=180)
    assert all(r.ok and r.turns == TURNS for r in results), [r.error for r in results][:3]
    per_server = [sim_stats(s)["chat_by_agent"] for s in two_sims]
    served = [sorted(k for k, n in counts.items() if n == TURNS) for counts in per_server]
    assert [len(keys) for keys in served] == [agents // 2] * 2, served


@pytest.mark.parametrize("backend, named", [
    (["vllm://127.0.0.1:8000", "vllm://127.0.0.1:8000/v1"], "the same server twice"),
    (["http://Host.example:9000", "sglang://host.example:9000"], "the same server twice"),
    (["openai://api.openai.com", "vllm://127.0.0.1:8000"], "mixes openai:// with vllm"),
    (["anthropic://api.anthropic.com", "bedrock://us-east-1"], "mixes anthropic:// with bedrock"),
])
def test_a_pool_of_duplicates_or_mixed_models_is_refused_at_submit(
        backend: list[str], named: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from agentbatch import BatchSpecError

    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-test")
    with pytest.raises(BatchSpecError, match=f"backend.*{named}"):
        submit_batch("Agent {i}.", [{"i": 0}], model="m", backend=backend)
