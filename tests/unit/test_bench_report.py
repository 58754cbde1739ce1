"""benchmarks/report.py renders docs/results.md's tables from result JSONs, benchmarks/plot.py
reads its bars from them; workloads render valid tasks."""

from __future__ import annotations

import json

import pytest

from agentbatch.sim.script import parse_script
from benchmarks.plot import engine_bars, sim_bars
from benchmarks.report import (
    BEGIN,
    DOCS_PAGE,
    END,
    RESULTS_DIR,
    load_results,
    main,
    render_all,
    render_file,
    replace_section,
)
from benchmarks.workloads import WORKLOADS, get_workload


def _run(wall: float, cpu: float) -> dict:
    return {"wall_s": wall, "ok": 4, "agents_per_s": 4 / wall, "model_requests": 8,
            "tool_executions": 4, "tool_calls": 4, "tool_calls_shared": 0, "cpu_s": cpu,
            "cpu_ms_per_turn": cpu * 1e3 / 8, "wall_over_critical_path": wall / 0.32,
            "errors": []}


def _system(label: str, walls: list[float]) -> dict:
    runs = [_run(w, 0.01) for w in walls]
    med = dict(runs[len(runs) // 2])
    return {"label": label, "settings": {}, "runs": runs, "median": med}


EMBEDDED = {
    "benchmark": "embedded",
    "created": "2026-01-01T00:00:00Z",
    "workload": {"name": "tool_roundtrip", "agents": 4, "fixed_ms": 60.0, "tool_ms": 200.0,
                 "tool_rounds": 1, "distinct_keys": None},
    "agents": 4,
    "runs": 3,
    "critical_path_s": 0.32,
    "machine": {"cpus_usable": 2, "python": "3.11.7", "loadavg_at_start": [1.5, 1.0, 1.0],
                "packages": {"agentbatch": "0.1.0", "batch-agent": None},
                "agentbatch_http_client": "aiohttp"},
    "systems": {
        "agentbatch": _system("agentbatch embedded", [0.4, 0.5, 0.6]),
        "naive_gather": _system("naive gather", [0.35, 0.36, 0.37]),
    },
    "ratios": {"agentbatch_wall_over_naive_gather_wall": 1.388,
               "agentbatch_wall_over_naive_gather_wall_paired": [1.14, 1.39, 1.62],
               "agentbatch_cpu_per_turn_over_naive_gather": 1.0},
}

HTTP = {
    "benchmark": "http_clients", "created": "2026-01-01T00:00:00Z", "concurrency": 200,
    "rounds": 5, "repeats": 3, "fixed_ms": 60.0, "machine": {},
    "clients": {
        "httpx": {"label": "one httpx", "median": {"cpu_ms_per_request": 15.0, "wall_s": 9.0,
                                                   "ok": 1000, "requests": 1000}},
        "aiohttp": {"label": "aiohttp", "median": {"cpu_ms_per_request": 0.5, "wall_s": 0.6,
                                                   "ok": 1000, "requests": 1000}},
    },
}


def test_embedded_table_has_a_row_per_system_and_the_ratios():
    text = render_file(EMBEDDED)
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(rows) == 3  # header + 2 systems
    assert rows[1].startswith("| agentbatch embedded | 0.500 | 0.40, 0.50, 0.60 | 1.6x |")
    assert "4/4" in rows[1]
    assert "agentbatch wall / naive_gather wall = **1.39** (paired runs: 1.14, 1.39, 1.62)" in text
    assert "critical path 0.320 s" in text
    assert "batch-agent" not in text.split("_2026")[1]  # packages without a version are left out


def test_http_table_is_relative_to_aiohttp():
    text = render_file(HTTP)
    assert "| one httpx | 15.00 | 30.0x | 9.000 | 1000 | 1000 |" in text
    assert "| aiohttp | 0.50 | 1.0x |" in text


def test_unknown_benchmark_kind_is_reported_not_raised():
    assert "no renderer" in render_file({"benchmark": "other"})


def test_render_all_reads_result_files(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(EMBEDDED))
    (tmp_path / "broken.json").write_text("{")
    out = render_all(load_results(tmp_path))
    assert "Source: `a.json`" in out and "broken" not in out
    assert render_all([]) == "_No results yet._"


def test_replace_section_keeps_the_text_around_the_markers():
    readme = f"intro\n\n{BEGIN}\nold table\n{END}\n\noutro\n"
    new = replace_section(readme, "NEW")
    assert new.startswith("intro\n\n") and new.endswith("\n\noutro\n")
    assert "NEW" in new and "old table" not in new
    assert replace_section(new, "NEWER").count(BEGIN) == 1
    assert replace_section("no markers", "X").endswith(f"{BEGIN}\n\nX\n\n{END}\n")


def test_write_rewrites_the_marked_section_of_the_page(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "a.json").write_text(json.dumps(EMBEDDED))
    page = tmp_path / "results.md"
    page.write_text(f"# Results\n\n{BEGIN}\nold table\n{END}\n\noutro\n")
    assert main(["--results", str(results), "--write", str(page)]) == 0
    text = page.read_text()
    assert text.startswith("# Results\n\n") and text.endswith("\n\noutro\n")
    assert "old table" not in text and "| agentbatch embedded | 0.500 |" in text


def test_the_docs_results_page_holds_the_tables_of_the_committed_results():
    """The page's tables are generated, never edited by hand: regenerating changes nothing."""
    page = DOCS_PAGE.read_text()
    body = render_all(load_results(RESULTS_DIR), root=RESULTS_DIR.resolve().parent.parent)
    assert replace_section(page, body) == page, "run: python -m benchmarks.report --write"
    assert "Source: `benchmarks/results/engine.json`" in page


def test_plot_bars_come_from_the_result_files():
    engine = {"summary": {"tools_40": {
        "naive": {"wall_ratio_to_naive": 1.0, "valid_median": 40, "timed_out_runs": 0},
        "embedded": {"wall_ratio_to_naive": 0.71, "valid_median": 40, "timed_out_runs": 0},
        "batch_agent": {"wall_ratio_to_naive": 1.58, "valid_median": 0, "timed_out_runs": 1},
        "naive_stream": {"wall_ratio_to_naive": 1.0, "valid_median": 40}}}}
    [(workload, bars)] = engine_bars(engine)
    assert workload == "tools_40"
    assert [(b["key"], b["ratio"], b["valid"], b["cut_off"]) for b in bars] == [
        ("embedded", 0.71, 40, False), ("naive", 1.0, 40, False),
        ("batch_agent", 1.58, 0, True)]  # systems the plot does not show are left out
    assert [(b["label"], b["wall"]) for b in sim_bars(EMBEDDED)] == [
        ("agentbatch embedded", 0.5), ("naive asyncio.gather (aiohttp)", 0.36)]


def test_plot_draws_a_png_from_the_committed_results(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot needs the docs extra")
    from benchmarks.plot import draw

    out = draw(RESULTS_DIR, tmp_path / "peers.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_workload_tasks_script_one_tool_call_per_round():
    for wl in WORKLOADS.values():
        inputs = wl.inputs(12)
        tasks = [wl.task.format(**item) for item in inputs]
        script = parse_script([tasks[0]])
        assert not script.errors
        assert [[c.name for c in r] for r in script.rounds] == [["lookup"]] * wl.tool_rounds
        assert script.rounds[0][0].arguments == {"key": inputs[0]["key_0"]}
        keys = {item["key_0"] for item in inputs}
        assert len(keys) == (12 if wl.distinct_keys is None else min(12, wl.distinct_keys))


def test_critical_path_is_two_passes_and_one_tool_call():
    wl = get_workload("tool_roundtrip")
    assert wl.agents == 200 and abs(wl.critical_path_s - 0.32) < 1e-9
    assert wl.expected_model_turns() == 400 and wl.expected_tool_executions() == 200
    assert get_workload("tool_roundtrip_shared").expected_tool_executions() == 10


def _kind(owners: list[tuple[str, float, float]], blocking: float, tasks: int) -> dict:
    """A py-spy kind section: (owner, share of samples, ms per task when not blocked)."""
    return {"samples": 100, "cpu_s": 2.0, "tasks": tasks, "task_unit": "x",
            "cpu_ms_per_task": 2000 / tasks, "agentbatch_on_stack_share": 0.5,
            "blocking_call_share": blocking,
            "owners": [{"owner": o, "share": s, "cpu_ms_per_task": 0.0} for o, s, _ in owners],
            "owners_running": [{"owner": o, "share": 0.0, "cpu_ms_per_task": ms}
                               for o, _, ms in owners]}


PROFILE = {
    "benchmark": "profile_fleet", "when": "2026-01-01T00:00:00Z", "machine": {},
    "workload": {"agents": 100, "tool_rounds": 3, "fixed_ms": 60.0, "tool_s": 0.2,
                 "inference_workers": 4, "tool_workers": 2, "threads_per_worker": 16},
    "py_spy": {
        "rate_hz": 200, "py_spy_cpu_s": 7.5, "late_warnings": 3,
        "inference": _kind([("agentbatch.distributed.state", 0.4, 2.5), ("kombu", 0.3, 1.25)],
                           0.3, 400),
        "tools": _kind([("kombu", 0.5, 3.0)], 0.5, 300),
        "all_workers": {
            "owners": [{"owner": "kombu", "share": 0.6, "cpu_ms_per_task": 1.5},
                       {"owner": "agentbatch.distributed.state", "share": 0.4,
                        "cpu_ms_per_task": 1.0}],
            "top_agentbatch": [
                {"function": f"agentbatch/distributed/state/redis_store.py:f{i}",
                 "inference_share": 0.1,
                 "tools_share": 0.0, "cpu_ms_per_task": 1.0 - i / 20} for i in range(12)]},
    },
    "yappi": {"error": "the yappi worker wrote no stats to /tmp/x"},
}


def test_profile_fleet_renders_owner_shares_per_kind_and_top_ten_functions():
    text = render_file(PROFILE)
    assert "100 agents x 3 tool rounds, 4 inference + 2 tool worker processes" in text
    # owners in the order of their CPU across all workers; a kind without them shows "-"
    assert "| kombu | 30.0% | 1.250 | 50.0% | 3.000 | 1.500 |" in text
    assert "| agentbatch.distributed.state | 40.0% | 2.500 | - | - | 1.000 |" in text
    assert text.index("| kombu |") < text.index("| agentbatch.distributed.state |")
    assert "| (at a blocking call: epoll, lock wait) | 30.0% | - | 50.0% | - | - |" in text
    assert "| `agentbatch/distributed/state/redis_store.py:f0` | 10.0% | 0.0% | 1.000 |" in text
    assert "f9`" in text and "f10`" not in text  # the top 10 only
    assert "(**5.00 ms/turn**)" in text and "3 'behind in sampling' warnings" in text
    assert "- yappi: the yappi worker wrote no stats" in text


def test_engine_costs_predict_walls_from_token_counts():
    from benchmarks.bench_engine_costs import predict

    costs = {"prompt": {"s_per_token": 0.01}, "decode_1": {"s_per_token": 0.02},
             "decode_4": {"s_per_token": 0.02}}
    engine = {"summary": {"tools_40": {
        "naive": {"wall_s_median": 50.0, "engine_prompt_tokens_median": 1000,
                  "engine_generated_tokens_median": 2000},
        "embedded": {"wall_s_median": 40.0, "engine_prompt_tokens_median": 1200,
                     "engine_generated_tokens_median": 500},
        "batch_agent": {"wall_s_median": 90.0, "engine_prompt_tokens_median": 1,
                        "engine_generated_tokens_median": 1}}}}
    out = predict(costs, engine)
    assert out["tools_40"]["naive"]["predicted_wall_s"] == 50.0  # 1000 x 0.01 + 2000 x 0.02
    assert out["tools_40"]["embedded"]["predicted_wall_s"] == 22.0
    assert out["tools_40"]["embedded"]["ratio_to_naive"] == 0.8
    assert out["tools_40"]["embedded"]["ratio_floor_prompt_only"] == 0.24
    assert "batch_agent" not in out["tools_40"]
    text = render_file({"benchmark": "engine_costs", "costs": costs, "predicted": out,
                        "engine_json": {"path": "e.json", "commit": "abcdef0123"}})
    assert "| decoded, 4 requests at once | 20.00 |" in text
    assert "| tools_40 | embedded | 1200 | 500 | 40.0 | 22.0 | 0.80 |" in text
    assert "commit abcdef01" in text


def test_hedge_renders_medians_ratios_and_the_hedge_counters():
    data = json.loads((RESULTS_DIR / "hedge.json").read_text())
    text = render_file(data)
    assert "no renderer" not in text and "hedge_after=" in text
    ratios = data["ratios_hedged_over_unhedged"]
    p99 = next(line for line in text.splitlines() if line.startswith("| agent latency p99"))
    assert p99.split("|")[4].strip() == f"{ratios['agent_latency_p99_s']:.2f}"
    hedges = sum(r["hedge"]["hedges"] for r in data["runs"]["hedged"])
    assert f"{hedges} hedges" in text


def test_slot_carry_renders_a_row_per_size_with_the_ratio():
    from benchmarks.bench_slot_carry import summarise

    rows = [{"pages": 2, "mode": m, "case": "c", "conversation_tokens": 700,
             "moved_prompt_tokens": 720, "moved_computed_tokens": c, "moved_wall_s": w}
            for m, c, w in (("carried", 20, 0.5), ("cold", 700, 5.0), ("carried", 22, 0.7),
                            ("cold", 702, 6.0))]
    summary = summarise(rows)
    assert summary["pages_2"]["carried_wall_over_cold"] == pytest.approx(0.6 / 5.5)
    assert summary["pages_2"]["carried_moved_computed_tokens_median"] == 21
    text = render_file({"benchmark": "slot_carry", "summary": summary, "total_s": 9.0,
                        "carries": {"carried": 2, "not_carried": 0}})
    assert "| 2 | 700 | 2 | 701 | 21 | 5.50 | 0.60 | 0.11 |" in text, text


def test_pool_servers_get_the_added_flags_and_the_table_names_them():
    from benchmarks.bench_engine import _server_args

    args = type("A", (), {"server_defaults": True, "server_args": "--cache-ram 0"})()
    assert _server_args(args) == ("-c", "0", "--cache-ram", "0")
    args.server_defaults, args.server_args = False, ""
    assert _server_args(args) == ()
    data = {"benchmark": "engine_pool", "pool": {"servers": 2},
            "settings": {"server_args": "--cache-ram 0"}, "summary": {}}
    assert "every server also given `--cache-ram 0`" in render_file(data)
    del data["settings"]["server_args"]
    assert "also given" not in render_file(data)


def test_the_pinning_naive_client_splits_agents_evenly_and_the_table_says_how():
    from collections import Counter

    from benchmarks.bench_engine import pinned_server

    # longconv's 4 agents on 2 servers: 2 each (crc32 of the number put all 4 on one)
    assert Counter(pinned_server(i, 2) for i in range(4)) == {0: 2, 1: 2}
    assert Counter(pinned_server(i, 3) for i in range(6)) == {0: 2, 1: 2, 2: 2}
    data = {"benchmark": "engine_pool", "pool": {"servers": 2}, "summary": {},
            "settings": {"naive_hash_pinning": "agent i on server i mod N (pinned_server)"}}
    assert "`naive_hash` pins each agent to one server: agent i on server i mod N" in \
        render_file(data)
    del data["settings"]["naive_hash_pinning"]  # a run from before: said, not hidden
    assert "by crc32 of the agent's number" in render_file(data)
