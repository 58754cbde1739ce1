"""The fleet benchmark on two commits, interleaved: Redis commands, round trips and CPU per
task before and after a change that must not change them (issue 22 item 7).

    python -m benchmarks.fleet_before_after 8828085 HEAD --rounds 3 \\
        --json benchmarks/results/fleet_before_after.json

Each commit is checked out in a throwaway ``git worktree`` (removed at the end) and runs
``bench_distributed``'s agentbatch batch from there (its own workers, its own code: the
worktree first on PYTHONPATH), without the Celery floors: the MONITOR count of client
commands on a 50-agent batch, then one batch of ``--agents`` on a fresh fleet (4 inference
+ 2 tool workers, 16 threads, sim 60 ms, tool 0.2 s). Rounds alternate the commits, so
both see the machine's load alike; each run records the load averages around it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.machine import REPO, machine_info, utc_now, write_json

KEYS = ("redis_commands_per_task_incl_lua", "client_commands_per_task",
        "cpu_ms_per_task_all_processes", "wall_s")


def run_here(out: str, agents: int) -> None:
    """One run on the code importable here (the worktree's), written to ``out``."""
    from agentbatch.sim.config import SimConfig
    from agentbatch.sim.process import SimProcess
    from benchmarks.bench_distributed import client_commands_per_task, run_agentbatch
    from tests.support.redis_server import RedisServer

    os.environ["TEST_TOOL_SLEEP_S"] = "0.2"
    load_start = os.getloadavg()
    server = RedisServer().start()
    sim = SimProcess(SimConfig(fixed_ms=60.0)).start()
    backend = "sim://" + sim.url.split("://", 1)[1]
    try:
        monitor = client_commands_per_task(server, backend, 16)
        ours = run_agentbatch(server, backend, agents, 4, 2, 16)
    finally:
        sim.stop()
        server.cleanup()
    Path(out).write_text(json.dumps({"loadavg_start": load_start,
                                     "loadavg_end": os.getloadavg(),
                                     "redis_round_trips": monitor, "agentbatch": ours}))


def summary(run: dict[str, Any]) -> dict[str, Any]:
    ours, rt = run["agentbatch"], run["redis_round_trips"]
    return {"redis_commands_per_task_incl_lua": ours["redis_commands_per_task_incl_lua"],
            "client_commands_per_task": rt["client_commands_per_task"],
            "lua_internal_per_task": rt["lua_internal_per_task"],
            "cpu_ms_per_task_all_processes": ours["cpu_ms_per_task_all_processes"],
            "wall_s": ours["wall_s"], "ok": f"{ours['ok']}/{ours['agents']}",
            "loadavg_start": [round(x, 2) for x in run["loadavg_start"]],
            "loadavg_end": [round(x, 2) for x in run["loadavg_end"]]}


def medians(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    by: dict[str, dict[str, float]] = {}
    for commit in dict.fromkeys(r["commit"] for r in runs):
        mine = [r for r in runs if r["commit"] == commit]
        by[commit] = {k: round(statistics.median(r[k] for r in mine), 3) for k in KEYS}
    return by


def render(data: dict[str, Any]) -> str:
    """The runs and the medians per commit, for docs/results.md (``benchmarks.report``)."""
    w = data["workload"]
    head = (f"### Fleet benchmark before and after issue 22 ({w['agents']} agents, "
            f"{w['inference_workers']} inference + {w['tool_workers']} tool workers, sim "
            f"{w['fixed_ms']:.0f} ms, tool {w['tool_s']} s; commits interleaved)")
    rows = [[r["commit"][:7], r["round"], r["ok"], f"{r['redis_commands_per_task_incl_lua']}",
             f"{r['client_commands_per_task']}", f"{r['cpu_ms_per_task_all_processes']}",
             f"{r['wall_s']}", str(r["loadavg_start"][0]), str(r["loadavg_end"][0])]
            for r in data["runs"]]
    lines = ["| commit | round | ok | Redis commands / task (Lua incl.) | client commands / "
             "task (MONITOR) | CPU ms / task | wall s | load avg 1 min, start | end |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    med = ["| commit | Redis commands / task | client commands / task | CPU ms / task |",
           "|---|---|---|---|"]
    med += [f"| {c[:7]} (median) | {m['redis_commands_per_task_incl_lua']} | "
            f"{m['client_commands_per_task']} | {m['cpu_ms_per_task_all_processes']} |"
            for c, m in data["medians"].items()]
    note = data.get("note", "")
    return "\n".join([head, "", *lines, "", *med, *(["", note] if note else []), "",
                      f"_{data['when']}: load averages per run in the table._"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("commits", nargs=2, help="before and after (anything git rev-parse takes)")
    p.add_argument("--agents", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default="benchmarks/results/fleet_before_after.json")
    p.add_argument("--run-here", default=None, help=argparse.SUPPRESS)  # one run, internal
    args = p.parse_args(argv)
    if args.run_here:
        run_here(args.run_here, args.agents)
        return 0
    shas = [subprocess.run(["git", "rev-parse", c], capture_output=True, text=True, cwd=REPO,
                           check=True).stdout.strip() for c in args.commits]
    trees = [Path(tempfile.mkdtemp(prefix=f"wt-{sha[:7]}-")) / "tree" for sha in shas]
    for sha, tree in zip(shas, trees, strict=True):
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), sha], cwd=REPO,
                       check=True)
    runs: list[dict[str, Any]] = []
    try:
        for round_ in range(1, args.rounds + 1):
            for sha, tree in zip(shas, trees, strict=True):
                out = tree.parent / f"run{round_}.json"
                # this file runs from the worktree too: the same driver on both commits
                driver = Path(__file__).read_text()
                (tree.parent / "driver.py").write_text(driver)
                subprocess.run([sys.executable, str(tree.parent / "driver.py"), "x", "x",
                                "--agents", str(args.agents), "--run-here", str(out)],
                               cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                               check=True)
                runs.append({"commit": sha, "round": round_,
                             **summary(json.loads(out.read_text()))})
    finally:
        for tree in trees:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO)
    write_json(Path(args.json), {
        "benchmark": "fleet_before_after", "when": utc_now(), "machine": machine_info(),
        "workload": {"agents": args.agents, "inference_workers": 4, "tool_workers": 2,
                     "threads_per_worker": 16, "fixed_ms": 60.0, "tool_s": 0.2},
        "commits": {"before": shas[0], "after": shas[1]}, "runs": runs,
        "medians": medians(runs)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
