"""The Grafana dashboard's metric names exist after a real batch, and the counts match it.

Real workers (threads pool and prefork pool: prometheus_client's multiprocess mode) and the
embedded engine (``metrics_port=``), against the simulator and a real redis-server. Every
``/metrics`` body is read with prometheus_client's own text parser; every metric name in
every expression of ``deploy/grafana-agentbatch.json`` must be there, and the counters must
add up to what the batch's results say.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agentbatch import run_batch, submit_batch
from agentbatch.core.errors import BatchSpecError, ConfigError
from agentbatch.core.results import AgentResult
from agentbatch.metrics import metrics
from tests.support.tools import Answer, cached_lookup, lookup
from tests.support.workers import REPO

pytestmark = [pytest.mark.redis, pytest.mark.slow]

DASHBOARD = REPO / "deploy" / "grafana-agentbatch.json"
AGENTS = 5
# Two tool turns per agent: one call every agent makes alike (shared: cached or coalesced),
# one of its own (executed).
TASK = ('Agent {i}.\n@sim tool cached_lookup {{"key": "shared"}}\n'
        '@sim tool lookup {{"key": "k{i}"}}')
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
# Worker events (dropped duplicates, recoveries by the sweep, ...) have no embedded engine
# counterpart: its panel is the one the embedded engine leaves empty (docs/metrics.md).
WORKER_ONLY = {"agentbatch_events_total"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dashboard_names() -> set[str]:
    """Every metric name in every target expression of the dashboard."""
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert exprs and all("agentbatch_" in e for e in exprs)
    return {n for e in exprs for n in re.findall(r"\bagentbatch_[A-Za-z0-9_:]+", e)}


def _parse(text: str) -> Samples:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(port: int, deadline_s: float = 30) -> Samples:
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                return _parse(resp.read().decode())
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def total(samples: Samples, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def scrape_until_finished(port: int, agents: float, deadline_s: float = 60) -> Samples:
    """The worker counts an agent's end after its commit, which delivers the result: poll."""
    deadline = time.monotonic() + deadline_s
    while True:
        samples = scrape(port)
        if total(samples, "agentbatch_agents_finished_total") >= agents:
            return samples
        assert time.monotonic() < deadline, sorted({n for n, _ in samples})
        time.sleep(0.2)


def delta(after: Samples, before: Samples) -> Samples:
    out: Samples = defaultdict(float)
    for key, value in after.items():
        out[key] = value - before.get(key, 0.0)
    return out


def check_names(samples: Samples, *, worker: bool = True) -> None:
    present = {n for n, _ in samples}
    missing = sorted(dashboard_names() - present - (set() if worker else WORKER_ONLY))
    assert not missing, f"dashboard names missing from /metrics: {missing}"


def check_counts(d: Samples, results: list[AgentResult]) -> None:
    """The counters of one batch (``d``: after minus before) against its results."""
    assert total(d, "agentbatch_agents_finished_total") == len(results)
    assert total(d, "agentbatch_agents_finished_total", status="done") == \
        sum(r.ok for r in results)
    turns = sum(r.turns for r in results)
    assert total(d, "agentbatch_turns_total", outcome="replied") == turns
    calls = total(d, "agentbatch_turns_total")
    assert total(d, "agentbatch_model_latency_seconds_count") == calls
    assert total(d, "agentbatch_model_ttft_seconds_count") == turns  # streamed: every reply
    for kind in ("prompt", "cached", "completion"):
        assert total(d, "agentbatch_tokens_total", kind=kind) == \
            sum(getattr(r.usage, f"{kind}_tokens") for r in results), kind
    tool_calls = sum(len(r.tool_calls) for r in results)
    executed = total(d, "agentbatch_tool_executions_total")
    shared = total(d, "agentbatch_tool_shared_total")
    assert total(d, "agentbatch_tool_calls_total") == tool_calls == 2 * len(results)
    assert executed + shared == tool_calls, (executed, shared)
    assert shared >= len(results) - 1  # every agent's "shared" call but the one that ran
    assert sum(r.cached or r.coalesced for res in results for r in res.tool_calls) == shared


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_worker_metrics_hold_every_dashboard_name_and_count_the_batch(
        pool, redis_url, sim_url, start_workers):
    port = _free_port()
    start_workers(1, concurrency=4, pool=pool, extra_args=["--metrics-port", str(port)])
    handle = submit_batch(TASK, [{"i": i} for i in range(AGENTS)],
                          tools=[cached_lookup, lookup], output_schema=Answer,
                          model="sim-model", backend=sim_url + "?stream=1",
                          redis_url=redis_url)
    results = handle.wait(timeout=180)
    assert all(r.ok for r in results), [r.error for r in results]
    samples = scrape_until_finished(port, AGENTS)
    check_names(samples)
    check_counts(samples, results)
    assert total(samples, "agentbatch_model_inflight") == 0
    # the queues are read from Redis at scrape time, every priority list of both queues
    depths = {dict(ls)["queue"] + dict(ls)["priority"] for n, ls in samples
              if n == "agentbatch_queue_depth"}
    assert depths == {f"{q}{p}" for q in ("inference", "tools") for p in ("0", "3", "6", "9")}


def test_embedded_metrics_port_serves_the_same_names(redis_url, sim_url, monkeypatch):
    monkeypatch.setenv("TEST_REDIS_URL", redis_url)  # where the test tools count
    port = _free_port()
    before = _parse(generate_latest(metrics().registry).decode())  # this process's so far
    results = run_batch(TASK, [{"i": i} for i in range(AGENTS)],
                        tools=[cached_lookup, lookup], output_schema=Answer,
                        model="sim-model", backend=sim_url + "?stream=1", metrics_port=port,
                        progress=False)
    assert all(r.ok for r in results), [r.error for r in results]
    after = scrape(port)
    check_names(after, worker=False)
    check_counts(delta(after, before), results)


def test_metrics_port_in_use_is_refused_naming_it(redis_url, sim_url):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"metrics_port: port {port} .*already in use"):
            run_batch("Hi {i}", [{"i": 0}], model="sim-model", backend=sim_url,
                      metrics_port=port, progress=False)
        proc = subprocess.run(
            [sys.executable, "-m", "agentbatch.cli", "worker", "--redis-url", redis_url,
             "--metrics-port", str(port)], cwd=REPO, capture_output=True, text=True,
            timeout=120, env={**_env(), "AGENTBATCH_WORKER_IMPORTS": "tests.support"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"--metrics-port: port {port} on 127.0.0.1 is already in use" in \
        " ".join(proc.stderr.split())


def test_metrics_port_is_refused_on_the_distributed_engine(redis_url, sim_url):
    with pytest.raises(BatchSpecError, match="metrics_port is for the embedded engine"):
        submit_batch("Hi {i}", [{"i": 0}], model="sim-model", backend=sim_url,
                     redis_url=redis_url, metrics_port=_free_port())


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": str(Path(REPO))}
