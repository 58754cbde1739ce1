"""bench_cost's clairvoyant bound (``benchmarks/cost_bound.py``) on hand-made inputs: the
per-agent choice of sync turns, the turns read from the simulator's timelines, the sum."""

from __future__ import annotations

import pytest

from benchmarks.cost_bound import (
    AgentTurns,
    Turn,
    agent_turns,
    batch_misses,
    bound,
    cheapest_routing,
)

PRICES = {"prompt": 2.0, "cached_prompt": 2.0, "completion": 10.0,
          "batch_prompt": 1.0, "batch_cached_prompt": 1.0, "batch_completion": 5.0}


def test_nothing_goes_sync_when_all_batch_fits() -> None:
    c = cheapest_routing([10, 10, 10], [1, 1, 1], [1, 2, 3], [2, 4, 6], deadline_s=30)
    assert c.sync == (False, False, False) and c.cost_usd == 6 and not c.late


def test_the_cheapest_turn_that_is_enough_goes_sync_not_the_one_saving_most_time() -> None:
    # 32 s against 25: any one turn is enough; turn 1 saves the most time, turn 0 costs least
    c = cheapest_routing([10, 12, 10], [1, 1, 1], [1, 2, 3], [2, 4, 6], deadline_s=25)
    assert c.sync == (True, False, False)
    assert c.cost_usd == 2 + 2 + 3 and c.finish_s == 23 and not c.late


def test_two_cheap_turns_beat_one_dear_turn_that_alone_would_do() -> None:
    # 40 s against 22: turn 2 alone (+5) gets there, turns 0 and 1 together (+1 +1) too
    c = cheapest_routing([10, 10, 20], [1, 1, 1], [1, 1, 5], [2, 2, 10], deadline_s=22)
    assert c.sync == (True, True, False)
    assert c.cost_usd == 2 + 2 + 5 and c.finish_s == 22 and not c.late


def test_an_agent_no_routing_gets_in_on_time_goes_fastest_and_is_late() -> None:
    c = cheapest_routing([10, 10], [4, 4], [1, 1], [2, 2], deadline_s=5)
    assert c.sync == (True, True) and c.finish_s == 8 and c.late


def timeline(created: float, end: float, *items: tuple[str, int, int]) -> dict[str, object]:
    return {"created": created, "end": end, "cancelled": None, "items": [
        {"custom_id": cid, "ready": end, "fail": False, "prompt_tokens": p,
         "completion_tokens": c} for cid, p, c in items]}


def test_turns_come_in_batch_order_with_the_overhead_of_an_agent_no_hedge_cut() -> None:
    started = 100.0
    jobs = [
        timeline(109.0, 115.0, ("t9-abc-0-v5", 300, 20)),  # agent 0, turn 2 (listed first)
        timeline(101.0, 105.0, ("t1-abc-0-v1", 100, 10), ("t2-abc-1-v1", 100, 10)),
        timeline(104.0, 110.0, ("t5-abc-1-v3", 200, 10)),  # agent 1 moved on at 104 < 105
        timeline(50.0, 60.0, ("t0-old-0-v1", 1, 1)),  # an earlier pass's: ignored
        {"created": 101.0, "end": None, "cancelled": None, "items": []},  # held: ignored
    ]
    agents = agent_turns(jobs, {0: 17.0, 1: 12.0}, started)
    a = agents[0]
    assert [t.batch_s for t in a.turns] == [4.0, 6.0]
    assert [t.prompt_tokens for t in a.turns] == [100, 300]
    assert a.overhead_s == pytest.approx((17.0 - 10.0) / 2)
    assert agents[1].overhead_s is None  # a hedge won its first turn: its overhead unknown


def test_distributed_custom_ids_name_the_agent_too() -> None:
    agents = agent_turns([timeline(1.0, 3.0, ("ab-0123456789012345-7-2", 10, 1))],
                         {7: 4.0}, 0.0)
    assert list(agents) == [7] and agents[7].overhead_s == pytest.approx(2.0)


def test_the_bound_sums_the_cheapest_routing_at_the_prices() -> None:
    turn = Turn(batch_s=10.0, prompt_tokens=1_000_000, completion_tokens=0)  # $2 sync, $1 batch
    agents = {0: AgentTurns((turn, turn), overhead_s=1.0),  # 22 s all-batch
              1: AgentTurns((turn, turn), overhead_s=None),  # the median: 1.0
              2: AgentTurns((turn,), overhead_s=1.0)}  # 11 s
    out = bound(agents, deadline_s=15.0, sync_turn_s=2.0, prices=PRICES)
    # agents 0 and 1 need one turn sync ($3 each), agent 2 none ($1)
    assert out["cost_usd"] == pytest.approx(7.0) and out["sync_turns"] == 2
    assert out["all_sync_usd"] == pytest.approx(10.0) and out["late"] == 0
    assert batch_misses(agents, 15.0) == 2
    tight = bound(agents, deadline_s=3.0, sync_turn_s=2.0, prices=PRICES, overhead_s=0.0)
    assert tight["late"] == 2 and tight["cost_usd"] == pytest.approx(10.0)  # 1 agent fits


def result_file(clairvoyant: bool) -> dict[str, object]:
    auto = {"wall_s": 9.0, "turns": 6, "provider_batch": {"served_batch": 4}}
    deadline = {"deadline_s": 8.0, "deadline_over_batch_wall": 0.8,
                "misses": {"sync": 0, "batch": 1, "auto": 0}, "auto_cost_over_sync": 0.7,
                "batch_cost_over_sync": 0.6, "auto": auto}
    data: dict[str, object] = {
        "config": {"agents": 2, "batch_median_s": 4.0, "batch_spread": 0.5, "scale": 300.0,
                   "sync_ms": 50.0},
        "runs": {"sync": {"cost_usd": 1.0, "wall_s": 1.0}, "batch": {"cost_usd": 0.6,
                                                                    "wall_s": 10.0}},
        "deadlines": {"missed_by_batch": deadline},
        "target": {"auto_cost_over_sync": 0.7, "auto_misses": 0, "met": False},
        "machine": {"cpus_usable": 2, "loadavg_at_start": [1.0]}, "created": "now"}
    if clairvoyant:
        deadline["clairvoyant_cost_over_sync"] = 0.5512
        data["clairvoyant"] = {
            "batch_turn_s_p50": 8.1, "overhead_per_turn_s_p50": 0.7, "sync_turn_s": 1.4,
            "floor_sync_turn_s": 0.05, "deadlines": {"missed_by_batch": {
                "cost_over_sync": 0.5512, "sync_turns": 1, "late": 0,
                "floor_cost_over_sync": 0.53}}}
    return data


def test_the_docs_table_shows_the_bound_beside_auto_and_old_files_still_render() -> None:
    from benchmarks.bench_cost import render

    text = render(result_file(True))
    assert "| auto cost / sync | clairvoyant cost / sync |" in text
    assert "| 0.700 | 0.551 | 0.600 |" in text
    assert "missed_by_batch 0.551 (1 turns sync, 0 late)" in text
    assert "sync turn of 50 ms: missed_by_batch 0.530." in text
    old = render(result_file(False))  # a result file from before the bound
    assert "| 0.700 | - | 0.600 |" in old and "Clairvoyant" not in old


def test_no_rounds_is_refused_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.bench_cost import main

    with pytest.raises(SystemExit) as exc:
        main(["--rounds", "0"])
    assert exc.value.code == 2
    assert "--rounds must be at least 1, got 0" in capsys.readouterr().err
