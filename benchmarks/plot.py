"""Draw ``docs/img/peers.png``: agentbatch against its peers, from ``benchmarks/results/*.json``.

    python -m benchmarks.plot                 # needs the docs extra (matplotlib)

Two panels, every number read from a result file (nothing typed by hand):

- the real engine (``engine.json``): each system's median wall time over the naive
  ``AsyncOpenAI`` + ``asyncio.gather`` loop's, per workload; a run that delivered no valid
  result (batch-agent, cut off) is hatched and labelled so;
- the simulator (``embedded_tool_roundtrip*.json``): median wall time of each system.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.report import RESULTS_DIR

OUT = Path(__file__).resolve().parent.parent / "docs" / "img" / "peers.png"

# (system key in engine.json, label, colour); naive is the 1.0 reference.
ENGINE_SYSTEMS = [
    ("embedded", "agentbatch embedded", "#1f6fb4"),
    ("distributed", "agentbatch distributed", "#6baed6"),
    ("naive", "naive AsyncOpenAI gather", "#7f7f7f"),
    ("batch_agent", "batch-agent 0.2.0", "#d62728"),
]
# (system key in embedded_*.json, label, colour)
SIM_SYSTEMS = [
    ("agentbatch", "agentbatch embedded", "#1f6fb4"),
    ("naive_gather", "naive asyncio.gather (aiohttp)", "#7f7f7f"),
    ("batch_agent", "batch-agent 0.2.0", "#d62728"),
]


def engine_bars(engine: dict[str, Any]) -> list[tuple[str, list[dict[str, Any]]]]:
    """Per workload: one entry per system present, with its ratio to naive and validity."""
    out = []
    for workload, systems in engine["summary"].items():
        agents = workload.rsplit("_", 1)[-1]
        bars = []
        for key, label, colour in ENGINE_SYSTEMS:
            s = systems.get(key)
            if not s or s.get("wall_ratio_to_naive") is None:
                continue
            bars.append({"key": key, "label": label, "colour": colour,
                         "ratio": s["wall_ratio_to_naive"], "valid": s.get("valid_median"),
                         "agents": agents, "cut_off": bool(s.get("timed_out_runs"))})
        out.append((workload, bars))
    return out


def sim_bars(data: dict[str, Any]) -> list[dict[str, Any]]:
    bars = []
    for key, label, colour in SIM_SYSTEMS:
        s = data["systems"].get(key)
        if s:
            bars.append({"label": label, "colour": colour, "wall": s["median"]["wall_s"],
                         "ok": s["median"]["ok"]})
    return bars


def draw(results: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    engine = json.loads((results / "engine.json").read_text())
    sims = [json.loads((results / f"{n}.json").read_text())
            for n in ("embedded_tool_roundtrip", "embedded_tool_roundtrip_shared")]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.2),
                                   gridspec_kw={"width_ratios": [1.5, 1]})

    groups = engine_bars(engine)
    width = 0.8 / len(ENGINE_SYSTEMS)
    for gi, (_, bars) in enumerate(groups):
        for bar in bars:
            si = [k for k, _, _ in ENGINE_SYSTEMS].index(bar["key"])
            x = gi + (si - (len(ENGINE_SYSTEMS) - 1) / 2) * width
            failed = bar["valid"] == 0
            ax1.bar(x, bar["ratio"], width, color=bar["colour"],
                    hatch="//" if failed else None, edgecolor="white" if failed else None,
                    label=bar["label"] if gi == 0 else None)
            note = f"{bar['ratio']:.2f}"
            if failed:
                note += f"\n0/{bar['agents']} valid" + (", cut off" if bar["cut_off"] else "")
            ax1.text(x, bar["ratio"] + 0.08, note, ha="center", va="bottom", fontsize=7.5)
    ax1.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax1.set_xticks(range(len(groups)), [w for w, _ in groups])
    ax1.set_ylabel("wall time / naive loop's (lower is better)")
    ax1.set_ylim(0, max(b["ratio"] for _, bs in groups for b in bs) * 1.25)
    for gi, (_, bars) in enumerate(groups):
        if "batch_agent" not in {b["key"] for b in bars}:
            ax1.text(gi + 1.5 * width, 0.05, "batch-agent\nnot run", ha="center", va="bottom",
                     fontsize=7, color="#d62728")
    cores = (engine.get("machine") or {}).get("cpus_usable", "?")
    ax1.set_title(f"Real engine: llama-server, SmolLM2-135M, {cores} CPU cores\n"
                  f"(medians of up to {engine['settings']['rounds']} runs, engine.json)",
                  fontsize=10)
    ax1.legend(fontsize=8, loc="upper center")

    labels = [f"{d['workload']['name']}\n"
              f"({d['workload']['distinct_keys'] or 'distinct'} tool keys)" for d in sims]
    width2 = 0.8 / len(SIM_SYSTEMS)
    for gi, data in enumerate(sims):
        for si, bar in enumerate(sim_bars(data)):
            x = gi + (si - (len(SIM_SYSTEMS) - 1) / 2) * width2
            ax2.bar(x, bar["wall"], width2, color=bar["colour"],
                    label=bar["label"] if gi == 0 else None)
            ax2.text(x, bar["wall"] * 1.08, f"{bar['wall']:.2f} s", ha="center", va="bottom",
                     fontsize=7.5)
    crit = sims[0]["critical_path_s"]
    ax2.axhline(crit, color="black", linewidth=0.8, linestyle="--")
    ax2.text(1.45, crit * 0.8, f"critical path {crit:.2f} s", ha="right", va="top",
             fontsize=7.5)
    ax2.set_yscale("log")
    ax2.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax2.set_ylim(crit * 0.5, max(b["wall"] for d in sims for b in sim_bars(d)) * 3)
    ax2.set_xticks(range(len(sims)), labels)
    ax2.set_ylabel("wall time, s (log scale; lower is better)")
    wl = sims[0]["workload"]
    ax2.set_title(f"Simulator: {sims[0]['agents']} agents, {wl['fixed_ms']:g} ms/forward pass, "
                  f"{wl['tool_rounds']}x {wl['tool_ms']:g} ms tool\n"
                  f"(medians of {sims[0]['runs']} runs, embedded_tool_roundtrip*.json)",
                  fontsize=10)
    ax2.legend(fontsize=8, loc="upper left")

    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.plot")
    p.add_argument("--results", default=str(RESULTS_DIR))
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args(argv)
    print(f"wrote {draw(Path(args.results), Path(args.out))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
