"""The simulator's and the worker's /metrics bodies read back with prometheus_client's parser."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agentbatch.backends.prom import parse_server_load
from agentbatch.sim.metrics import SimStats, render_prometheus
from agentbatch.workers import metrics as worker_metrics


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


def test_worker_exposition_counts_events(monkeypatch: pytest.MonkeyPatch) -> None:
    stats = Counter({"turn_done": 7, "tool_error": 2, 'odd "event"': 1})
    monkeypatch.setattr(worker_metrics, "worker_context", lambda: SimpleNamespace(stats=stats))
    families = list(text_string_to_metric_families(worker_metrics.render().decode()))
    assert [(f.name, f.type) for f in families] == [("agentbatch_events", "counter")]
    assert {(s.name, s.labels["event"]): s.value for s in families[0].samples} == {
        ("agentbatch_events_total", "turn_done"): 7.0,
        ("agentbatch_events_total", "tool_error"): 2.0,
        ("agentbatch_events_total", 'odd "event"'): 1.0,
    }


def test_worker_exposition_without_events(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_metrics, "worker_context",
                        lambda: SimpleNamespace(stats=Counter()))
    families = list(text_string_to_metric_families(worker_metrics.render().decode()))
    assert [(f.name, f.samples) for f in families] == [("agentbatch_events", [])]
