"""The simulator's and agentbatch's /metrics bodies read back with prometheus_client's parser."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agentbatch import metrics as agentbatch_metrics
from agentbatch.backends.prom import parse_server_load
from agentbatch.core.errors import BatchSpecError, RateLimited
from agentbatch.core.model_io import ModelResponse, Usage
from agentbatch.distributed.workers.app import PRIORITY_STEPS
from agentbatch.metrics import EventCounter
from agentbatch.metrics.collectors import queue_lists
from agentbatch.metrics.server import build_registry, check_metrics_port
from agentbatch.sim.metrics import SimStats, render_prometheus


def _samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _sim_stats() -> SimStats:
    stats = SimStats(prompt_tokens=400, cached_tokens=300, completion_tokens=50, success=3)
    stats.set_load(running=5, waiting=2)
    for seconds in (0.003, 0.03, 0.03, 100.0):  # the last one only in +Inf
        stats.ttft.observe(seconds)
    return stats


def test_sim_exposition_parses_back_with_vllm_names() -> None:
    text = render_prometheus(_sim_stats(), 'm"odel\\', cache_usage=0.25)
    model = frozenset({("model_name", 'm"odel\\')})
    samples = _samples(text)
    assert samples[("vllm:num_requests_running", model)] == 5.0
    assert samples[("vllm:num_requests_waiting", model)] == 2.0
    assert samples[("vllm:gpu_cache_usage_perc", model)] == 0.25
    assert samples[("vllm:gpu_prefix_cache_hit_rate", model)] == 0.75
    assert samples[("vllm:prefix_cache_queries_total", model)] == 400.0
    assert samples[("vllm:prefix_cache_hits_total", model)] == 300.0
    assert samples[("vllm:prompt_tokens_total", model)] == 400.0
    assert samples[("vllm:generation_tokens_total", model)] == 50.0
    assert samples[("vllm:request_success_total", model | {("finished_reason", "stop")})] == 3.0

    bucket = "vllm:time_to_first_token_seconds_bucket"
    assert samples[(bucket, model | {("le", "0.001")})] == 0.0
    assert samples[(bucket, model | {("le", "0.005")})] == 1.0
    assert samples[(bucket, model | {("le", "0.04")})] == 3.0  # cumulative
    assert samples[(bucket, model | {("le", "80.0")})] == 3.0
    assert samples[(bucket, model | {("le", "+Inf")})] == 4.0
    assert samples[("vllm:time_to_first_token_seconds_count", model)] == 4.0
    assert samples[("vllm:time_to_first_token_seconds_sum", model)] == pytest.approx(100.063)
    assert not [name for name, _ in samples if name.endswith("_created")]


def test_sim_exposition_gives_the_server_load() -> None:
    load, counters = parse_server_load(render_prometheus(_sim_stats(), "sim", 0.5))
    assert load is not None and load.queue_known
    assert (load.running, load.waiting) == (5.0, 2.0)
    assert load.prefix_cache_hit_rate == pytest.approx(0.75)
    assert counters is not None and (counters.hits, counters.queries) == (300.0, 400.0)


def _agentbatch_samples() -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """This process's agentbatch_* metrics as served (the registry a server builds)."""
    return _samples(generate_latest(build_registry()).decode())


def _delta(before: dict, after: dict, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_worker_events_count_in_agentbatch_events_total() -> None:
    before = _agentbatch_samples()
    stats = EventCounter()  # what WorkerContext.stats is
    stats["turn_done"] += 7
    stats['odd "event"'] += 1
    stats["turn_done"] += 2
    after = _agentbatch_samples()
    assert stats["turn_done"] == 9
    assert _delta(before, after, "agentbatch_events_total", event="turn_done") == 9.0
    assert _delta(before, after, "agentbatch_events_total", event='odd "event"') == 1.0


def test_model_calls_and_tools_are_counted_by_their_labels() -> None:
    before = _agentbatch_samples()
    with agentbatch_metrics.model_call("sim://x"):
        pass
    response = ModelResponse(text="ok", usage=Usage(prompt_tokens=40, cached_tokens=30,
                                                    completion_tokens=5), ttft_s=0.02)
    agentbatch_metrics.record_reply("sim://x", response)
    with pytest.raises(RateLimited), agentbatch_metrics.model_call("sim://x"):
        raise RateLimited("slow down")
    for counter in ("calls", "executions", "calls", "cache_hits"):
        agentbatch_metrics.record_tool("t_exposition", counter)
    after = _agentbatch_samples()
    turns = "agentbatch_turns_total"
    assert _delta(before, after, turns, outcome="replied", error_kind="") == 1.0
    assert _delta(before, after, turns, outcome="failed", error_kind="rate_limited") == 1.0
    assert _delta(before, after, "agentbatch_tokens_total", kind="cached") == 30.0
    assert _delta(before, after, "agentbatch_model_latency_seconds_count",
                  backend="sim://x") == 2.0
    assert _delta(before, after, "agentbatch_model_ttft_seconds_count", backend="sim://x") == 1
    assert after[("agentbatch_model_inflight", frozenset({("backend", "sim://x")}))] == 0.0
    tool = {"tool": "t_exposition"}
    assert after[("agentbatch_tool_calls_total", frozenset(tool.items()))] == 2.0
    assert after[("agentbatch_tool_executions_total", frozenset(tool.items()))] == 1.0
    assert after[("agentbatch_tool_shared_total",
                  frozenset({**tool, "how": "cached"}.items()))] == 1.0
    # every counter of a tool exists from its first call, so a dashboard finds it at 0
    assert after[("agentbatch_tool_timeouts_total", frozenset(tool.items()))] == 0.0


def test_queue_lists_are_the_lists_keda_scales_on() -> None:
    keda = Path(__file__).resolve().parents[2] / "k8s" / "keda.yaml"
    listed = {t["metadata"]["listName"] for doc in yaml.safe_load_all(keda.read_text())
              if doc for t in doc["spec"].get("triggers", [])}
    assert {name for q in ("inference", "tools")
            for _, name in queue_lists(q, PRIORITY_STEPS)} == listed


@pytest.mark.parametrize("port", [0, 65536, True, "9100", 9100.0])
def test_metrics_port_must_be_a_port_number(port: object) -> None:
    with pytest.raises(BatchSpecError, match="metrics_port must be a port number"):
        check_metrics_port(port, None)
