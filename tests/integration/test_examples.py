"""Each example in examples/ runs as a user would run it: a subprocess, with no backend
configured (it starts its own simulator), and exits 0. The real-engine example runs against
llama-server in tests/engine/test_engine_example.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import needs_redis
from tests.support.workers import REPO

EXAMPLES = REPO / "examples"
DEADLINE_S = 240  # generous: the machine is shared, and each example starts a simulator
# example -> a line its output must contain (what it is there to show)
EXPECTED = {
    "quickstart": "0 Loved it",
    "tools_schema": "10 tool calls, 3 actual lookups",
    "scatter_gather": "scatter_gather: ['GENE0', 'GENE1'",
    "reduce": "map: 6/6 ok",
    "map_reduce": "survey: title=",
    "distributed": "'done': 20, 'total': 20",
    "checkpoint_resume": "after resume: 6/6 ok",
    "cost_auto": "6/6 ok, spent $",
}
ELSEWHERE = {"real_engine"}  # tests/engine/test_engine_example.py


def run_example(name: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("AGENTBATCH_BACKEND", "AGENTBATCH_MODEL", "AGENTBATCH_REDIS_URL")}
    return subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), *args], cwd=REPO,
                          env={**clean, **env}, capture_output=True, text=True,
                          timeout=DEADLINE_S)


def assert_cost_auto_served(stdout: str, engine: str) -> None:
    """cost_auto's last line: every turn counted once, by the batch API or the sync API (from
    the handle's counters), some by the batch API, on the engine asked for."""
    found = re.search(r"(\d+) of (\d+) turns by the batch API, (\d+) by the sync API, "
                      r"on the (\w+) engine", stdout)
    assert found, stdout[-2000:]
    by_batch, turns, by_sync = (int(found[i]) for i in (1, 2, 3))
    assert (by_batch + by_sync, found[4]) == (turns, engine), stdout[-2000:]
    assert by_batch >= 1, stdout[-2000:]


def test_every_example_is_run_by_a_test():
    found = {p.stem for p in EXAMPLES.glob("*.py") if not p.stem.startswith("_")}
    assert found == set(EXPECTED) | ELSEWHERE


@pytest.mark.parametrize("name", [n for n in EXPECTED if n != "distributed"])
def test_example_runs_on_its_own_simulator(name):
    done = run_example(name)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert EXPECTED[name] in done.stdout, done.stdout[-2000:]
    if name == "cost_auto":
        assert_cost_auto_served(done.stdout, "embedded")


@needs_redis
@pytest.mark.redis
@pytest.mark.slow
def test_distributed_example_starts_redis_and_a_worker():
    done = run_example("distributed")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert EXPECTED["distributed"] in done.stdout


@needs_redis
@pytest.mark.redis
@pytest.mark.slow
def test_cost_auto_example_runs_distributed():
    """``--distributed``: pricing="auto" on a redis-server and one worker the example starts;
    the worker reaches the example's simulator through the URL in the batch's plan."""
    done = run_example("cost_auto", "--distributed")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert EXPECTED["cost_auto"] in done.stdout, done.stdout[-2000:]
    assert_cost_auto_served(done.stdout, "distributed")


def test_example_reads_the_backend_from_the_environment(sim, sim_url):
    done = run_example("quickstart", AGENTBATCH_BACKEND=sim_url, AGENTBATCH_MODEL="sim-model")
    assert done.returncode == 0, done.stderr[-3000:]
    assert sim.state.stats.as_dict()["requests"].get("chat_completions", 0) >= 5
