"""benchmarks/bench_cost.py runs end to end in a tiny configuration (a few agents, sub-second
provider batches) and writes the result file and docs table it is committed with; the
committed docs/cost.md table is the one its committed result renders to."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.bench_cost import BEGIN, END, main, render, write_docs
from benchmarks.report import RESULTS_DIR

DOCS = Path(__file__).resolve().parents[2] / "docs" / "cost.md"


def test_the_benchmark_runs_tiny_and_writes_its_json_and_table(tmp_path: Path) -> None:
    out, page = tmp_path / "cost.json", tmp_path / "cost.md"
    page.write_text("# Cost\n\nintro\n")
    assert main(["--agents", "3", "--batch-median-s", "0.2", "--batch-spread", "0",
                 "--sync-ms", "5", "--rounds", "2", "--json", str(out),
                 "--docs", str(page)]) == 0
    data = json.loads(out.read_text())
    assert data["benchmark"] == "cost" and data["machine"]["cpus_usable"] >= 1
    sync, batch = data["runs"]["sync"], data["runs"]["batch"]
    assert sync["ok"] == batch["ok"] == 3 and sync["turns"] == batch["turns"] == 9
    assert batch["provider_batch"]["served_batch"] == 9  # every turn through the batch API
    assert batch["cost_usd"] < sync["cost_usd"]
    assert set(data["deadlines"]) == {"easy", "tight", "missed_by_batch"}
    for d in data["deadlines"].values():
        assert d["auto"]["ok"] == 3 and set(d["misses"]) == {"sync", "batch", "auto"}
        assert d["auto_cost_over_sync"] == round(d["auto"]["cost_usd"] / sync["cost_usd"], 4)
    assert set(data["target"]) >= {"met", "auto_cost_over_sync", "auto_misses"}
    # two rounds: the target is on their median (of two: their mean), the detail is one of them
    assert len(data["rounds"]) == 2 and data["target"]["rounds"] == 2
    both = [r["missed_by_batch"]["auto_cost_over_sync"] for r in data["rounds"]]
    assert data["target"]["auto_cost_over_sync_all"] == both
    assert data["target"]["auto_cost_over_sync"] == round(sum(both) / 2, 4)
    assert data["deadlines"]["missed_by_batch"]["auto_cost_over_sync"] == min(both)
    assert data["median_round"] == both.index(min(both))
    text = page.read_text()
    assert text.startswith("# Cost\n\nintro\n") and BEGIN in text and END in text
    assert "| missed_by_batch |" in text


def test_docs_cost_page_holds_the_table_of_the_committed_result(tmp_path: Path) -> None:
    """The table is generated, never edited by hand: regenerating it changes nothing."""
    data = json.loads((RESULTS_DIR / "cost.json").read_text())
    page = tmp_path / "cost.md"
    page.write_text(DOCS.read_text())
    write_docs(page, data)
    assert page.read_text() == DOCS.read_text(), \
        "run: python -m benchmarks.bench_cost --render-only --docs docs/cost.md"
    assert render(data) in DOCS.read_text()
