"""Prometheus text parsing and the server-load view of vLLM / SGLang / Dynamo metrics."""

from __future__ import annotations

import math

import pytest

from agentbatch.backends.prom import (
    PrefixCounters,
    metric_mean,
    metric_sum,
    parse_prometheus,
    parse_server_load,
)

VLLM_OLD = """\
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="meta-llama/Llama-3.1-8B"} 7.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="meta-llama/Llama-3.1-8B"} 3.0
# HELP vllm:gpu_prefix_cache_hit_rate GPU prefix cache block hit rate.
# TYPE vllm:gpu_prefix_cache_hit_rate gauge
vllm:gpu_prefix_cache_hit_rate{model_name="meta-llama/Llama-3.1-8B"} 0.75
"""

VLLM_V1 = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="qwen"} 10.0
vllm:num_requests_running{engine="1",model_name="qwen"} 6.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="qwen"} 2.0
vllm:num_requests_waiting{engine="1",model_name="qwen"} 0.0
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="qwen"} 1000.0
vllm:prefix_cache_queries_total{engine="1",model_name="qwen"} 1000.0
vllm:prefix_cache_queries_created{engine="0",model_name="qwen"} 1.7170867012e+09
vllm:prefix_cache_queries_created{engine="1",model_name="qwen"} 1.7170867012e+09
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="qwen"} 900.0
vllm:prefix_cache_hits_total{engine="1",model_name="qwen"} 700.0
vllm:prefix_cache_hits_created{engine="0",model_name="qwen"} 1.7170867012e+09
vllm:prefix_cache_hits_created{engine="1",model_name="qwen"} 1.7170867012e+09
"""

SGLANG = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="llama",tp_rank="0"} 12.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="llama",tp_rank="0"} 5.0
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="llama",tp_rank="0"} 0.5
"""


def test_parse_samples_with_labels_and_timestamps() -> None:
    text = (
        'm{a="x",b="y, }z"} 1.5 1712345678000\n'
        'm{a="esc \\"q\\" \\\\ \\n"} 2\n'
        "plain 3e2\n"
        "m{} 4\n"
        "m_created 99\n"
        "broken{a=\n"
        "no_value\n"
        "nan_one NaN\n"
    )
    samples = parse_prometheus(text)
    by_value = {s.value: s for s in samples if not math.isnan(s.value)}
    assert by_value[1.5].labels == {"a": "x", "b": "y, }z"}
    assert by_value[2.0].labels == {"a": 'esc "q" \\ \n'}
    assert by_value[300.0].name == "plain"
    assert by_value[4.0].labels == {}
    assert all(not s.name.endswith("_created") for s in samples)
    assert metric_sum(samples, "m") == 7.5
    assert metric_sum(samples, "nan_one") is None  # non-finite values are skipped
    assert metric_sum(samples, "missing", "plain") == 300.0
    assert metric_mean(samples, "m") == 2.5


def test_a_malformed_line_loses_only_itself() -> None:
    """The parser gives up on a whole body at a bad line; every other line must still count."""
    bad_lines = (
        'vllm:num_requests_running{engine="2" 7\n'  # unterminated label set
        'vllm:num_requests_running{engine="3", ="x"} 9\n'  # prometheus_client: IndexError
        "vllm:num_requests_waiting{engine=\"4\"} not-a-number\n"
    )
    head, tail = VLLM_V1.split("# TYPE vllm:num_requests_waiting gauge\n")
    text = head + bad_lines + "# TYPE vllm:num_requests_waiting gauge\n" + tail
    load, counters = parse_server_load(text)
    assert load is not None
    assert (load.running, load.waiting) == (16.0, 2.0)
    assert counters == PrefixCounters(hits=1600.0, queries=2000.0)
    assert load.prefix_cache_hit_rate == pytest.approx(0.8)


def test_counter_names_typed_with_or_without_total() -> None:
    """llama.cpp types its counters under the ``_total`` name; others type the bare name."""
    text = (
        "# TYPE llamacpp:prompt_tokens_total counter\n"
        "llamacpp:prompt_tokens_total 100\n"
        "# TYPE other counter\n"
        "other 5\n"
    )
    samples = parse_prometheus(text)
    assert {s.name: s.value for s in samples} == {
        "llamacpp:prompt_tokens_total": 100.0, "other_total": 5.0}
    assert metric_sum(samples, "other") == metric_sum(samples, "other_total") == 5.0


def test_vllm_old_gauge_names() -> None:
    load, counters = parse_server_load(VLLM_OLD)
    assert load is not None
    assert (load.running, load.waiting) == (7.0, 3.0)
    assert load.prefix_cache_hit_rate == pytest.approx(0.75)
    assert counters is None


def test_vllm_v1_counters_sum_over_engines_and_ignore_created() -> None:
    load, counters = parse_server_load(VLLM_V1)
    assert load is not None
    assert (load.running, load.waiting) == (16.0, 2.0)
    # (900 + 700) / (1000 + 1000); the huge *_created timestamps must not be summed in.
    assert load.prefix_cache_hit_rate == pytest.approx(0.8)
    assert counters == PrefixCounters(hits=1600.0, queries=2000.0)


def test_vllm_counters_give_the_rate_since_the_previous_scrape() -> None:
    previous = PrefixCounters(hits=1500.0, queries=1800.0)
    load, _ = parse_server_load(VLLM_V1, previous)
    assert load is not None
    assert load.prefix_cache_hit_rate == pytest.approx(100.0 / 200.0)


def test_counter_reset_falls_back_to_lifetime_rate() -> None:
    load, _ = parse_server_load(VLLM_V1, PrefixCounters(hits=5000.0, queries=9000.0))
    assert load is not None
    assert load.prefix_cache_hit_rate == pytest.approx(0.8)


def test_intermediate_gpu_prefix_counter_names() -> None:
    text = (
        "vllm:num_requests_running 1\n"
        "vllm:gpu_prefix_cache_queries_total 10\n"
        "vllm:gpu_prefix_cache_hits_total 4\n"
    )
    load, _ = parse_server_load(text)
    assert load is not None and load.prefix_cache_hit_rate == pytest.approx(0.4)


def test_counters_with_zero_queries_have_no_rate() -> None:
    text = (
        "vllm:num_requests_running 0\n"
        "vllm:prefix_cache_queries_total 0\n"
        "vllm:prefix_cache_hits_total 0\n"
    )
    load, _ = parse_server_load(text)
    assert load is not None and load.prefix_cache_hit_rate is None


def test_sglang_names() -> None:
    load, _ = parse_server_load(SGLANG)
    assert load is not None
    assert (load.running, load.waiting, load.prefix_cache_hit_rate) == (12.0, 5.0, 0.5)


def test_dynamo_frontend_names() -> None:
    text = (
        'dynamo_frontend_inflight_requests{model="m"} 12\n'
        'dynamo_frontend_queued_requests{model="m"} 4\n'
    )
    load, _ = parse_server_load(text)
    assert load is not None
    assert (load.running, load.waiting, load.prefix_cache_hit_rate) == (8.0, 4.0, None)


def test_unrelated_metrics_give_no_load() -> None:
    text = "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 12.5\n"
    assert parse_server_load(text) == (None, None)
    assert parse_server_load("") == (None, None)
