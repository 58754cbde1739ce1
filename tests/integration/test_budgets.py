"""Budget caps on the embedded engine over real HTTP to the simulator: at max_cost_usd or
max_agent_cost_usd no new turn starts, turns already sent finish, and the agents that needed
another turn end ``budget_exceeded``; spend stays within the cap plus the turns in flight
when it was reached; the projection warns once the batch is on course to pass its cap.
Bad caps are refused before anything is sent."""

from __future__ import annotations

import pytest

from agentbatch import BatchSpecError, submit_batch
from tests.support.tools import Answer, lookup

MODEL = "sim-model"
PRICES = {MODEL: {"prompt": 3.0, "cached_prompt": 0.3, "completion": 15.0}}
TASK = 'Agent {i}.\n@sim tool lookup {{"key": "k{i}"}}'  # two turns: a tool call, the answer
WAIT_S = 180.0


def _run(sim_url: str, n: int, **opts):
    handle = submit_batch(TASK, [{"i": i} for i in range(n)], model=MODEL, backend=sim_url,
                          tools=[lookup], output_schema=Answer, prices=PRICES,
                          warm_prefix=False, **opts)
    results = handle.wait(timeout=WAIT_S)
    assert len(results) == n
    return handle, results


def _chat_requests(sim) -> int:
    return sim.state.stats.as_dict()["requests_total"]


def test_max_agent_cost_ends_each_agent_after_the_turn_that_reached_it(sim, sim_url) -> None:
    cap = 1e-9  # any one turn passes it: the first turn runs, the second never starts
    _, results = _run(sim_url, 5, max_agent_cost_usd=cap)
    assert [r.error.kind if r.error else None for r in results] == ["budget_exceeded"] * 5
    assert all("max_agent_cost_usd=1e-09 reached" in r.error.message for r in results)
    assert all(r.turns == 1 and r.cost_usd >= cap for r in results)
    assert _chat_requests(sim) == 5  # one model call per agent, none after its cap


def test_max_cost_stops_new_turns_and_spend_stays_within_cap_plus_turns_in_flight(
        sim, sim_url) -> None:
    _, free = _run(sim_url, 4)
    assert all(r.ok for r in free)
    per_agent = max(r.cost_usd for r in free)  # bounds any one turn's cost
    inflight = 2
    cap = 3 * per_agent  # about a quarter of the 12 agents' spend
    handle, results = _run(sim_url, 12, max_cost_usd=cap, max_inflight=inflight)
    spent = sum(r.cost_usd for r in results)
    kinds = [r.error.kind for r in results if not r.ok]
    assert sum(r.ok for r in results) >= 2 and kinds.count("budget_exceeded") >= 4, kinds
    assert set(kinds) == {"budget_exceeded"}
    assert spent >= cap  # the cap was reached before any agent was stopped
    assert spent <= cap + inflight * per_agent
    progress = handle.progress()
    assert progress.cost_usd == pytest.approx(spent)
    assert progress.failed_by_kind == {"budget_exceeded": len(kinds)}
    assert progress.budget_warning is not None and "passes max_cost_usd" in \
        progress.budget_warning


def test_projection_is_reported_without_a_warning_under_a_roomy_cap(sim_url) -> None:
    handle, results = _run(sim_url, 4, max_cost_usd=1000.0)
    assert all(r.ok for r in results)
    progress = handle.progress()
    assert progress.budget_warning is None
    assert progress.projected_cost_usd == pytest.approx(progress.cost_usd)  # nothing left


@pytest.mark.parametrize("opts,needle", [
    ({"max_cost_usd": -1.0}, "max_cost_usd must be a finite number >= 0"),
    ({"max_cost_usd": float("nan")}, "max_cost_usd must be a finite number >= 0"),
    ({"max_agent_cost_usd": float("inf")}, "max_agent_cost_usd must be a finite number >= 0"),
    ({"max_agent_cost_usd": "1"}, "max_agent_cost_usd must be a finite number >= 0"),
    ({"max_cost_usd": 1.0, "prices": None}, "max_cost_usd needs prices="),
])
def test_bad_caps_are_refused_before_anything_is_sent(sim, sim_url, monkeypatch, opts,
                                                      needle) -> None:
    monkeypatch.delenv("AGENTBATCH_PRICES", raising=False)
    with pytest.raises(BatchSpecError) as err:
        submit_batch(TASK, [{"i": 0}], model=MODEL, backend=sim_url, tools=[lookup],
                     **{"prices": PRICES, **opts})
    assert needle in str(err.value)
    assert _chat_requests(sim) == 0
