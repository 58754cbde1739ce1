"""Counters of what the simulator did: JSON for tests (``/sim/stats``), Prometheus for engines.

The Prometheus names match vLLM's, so the engine's backpressure and cache-hit probes run
unchanged against the simulator and a real server.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

# ``/v1/completions`` bodies kept for ``/sim/stats`` (tests check what a client sent).
RECENT_COMPLETIONS = 8

# vLLM's time-to-first-token buckets (seconds), trimmed at the top.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


@dataclass
class Histogram:
    """A fixed-bucket histogram (counts per bucket, cumulated only when rendered)."""

    buckets: tuple[float, ...] = TTFT_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1


@dataclass
class SimStats:
    """Everything counted since start or the last ``/sim/reset``."""

    requests: Counter[str] = field(default_factory=Counter)  # by endpoint
    faults: Counter[str] = field(default_factory=Counter)  # injected, by kind
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    success: int = 0
    bad_requests: int = 0
    rejected_queue_full: int = 0
    running: int = 0
    waiting: int = 0
    max_running_seen: int = 0
    max_waiting_seen: int = 0
    ttft: Histogram = field(default_factory=Histogram)
    # ``/tokenize`` and ``/detokenize`` calls: apart from ``requests`` (model calls only)
    template_requests: Counter[str] = field(default_factory=Counter)
    recent_completions: deque[dict[str, Any]] = field(
        default_factory=lambda: deque(maxlen=RECENT_COMPLETIONS))
    # chat requests by the sim's agent key (sha1 of the first user message): which server
    # each agent's turns reached (tests of a pool's routing)
    chat_by_agent: Counter[str] = field(default_factory=Counter)

    def set_load(self, running: int, waiting: int) -> None:
        self.running, self.waiting = running, waiting
        self.max_running_seen = max(self.max_running_seen, running)
        self.max_waiting_seen = max(self.max_waiting_seen, waiting)

    def reset(self) -> None:
        """Zero the counters; the current load stays (those requests are still in flight)."""
        running, waiting = self.running, self.waiting
        self.__init__()  # type: ignore[misc]
        self.set_load(running, waiting)

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": dict(self.requests),
            "requests_total": sum(self.requests.values()),
            "faults": dict(self.faults),
            "faults_total": sum(self.faults.values()),
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "success": self.success,
            "bad_requests": self.bad_requests,
            "rejected_queue_full": self.rejected_queue_full,
            "running": self.running,
            "waiting": self.waiting,
            "max_running_seen": self.max_running_seen,
            "max_waiting_seen": self.max_waiting_seen,
            "ttft_count": self.ttft.count,
            "ttft_mean_s": self.ttft.total / self.ttft.count if self.ttft.count else None,
            "template_requests": dict(self.template_requests),
            "recent_completions": list(self.recent_completions),
            "chat_by_agent": dict(self.chat_by_agent),
        }


class _SimCollector:
    """The simulator's counters as vLLM's metric families (a prometheus_client collector)."""

    def __init__(self, stats: SimStats, model: str, cache_usage: float) -> None:
        self.stats, self.model, self.cache_usage = stats, model, cache_usage

    def _one(self, family: GaugeMetricFamily | CounterMetricFamily, value: float,
             *labels: str) -> Metric:
        family.add_metric([self.model, *labels], value)
        return family

    def collect(self) -> Iterator[Metric]:
        stats, label = self.stats, ["model_name"]
        hit_rate = stats.cached_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0
        for name, help_, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.",
             stats.running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             stats.waiting),
            ("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.",
             self.cache_usage),
            ("vllm:gpu_prefix_cache_hit_rate", "GPU prefix cache block hit rate.", hit_rate),
        ):
            yield self._one(GaugeMetricFamily(name, help_, labels=label), value)
        # Exposed as ``<name>_total``; with no ``created`` given there is no ``*_created`` series.
        for name, help_, value in (
            ("vllm:prefix_cache_queries",
             "Prefix cache queries, in terms of number of queried tokens.", stats.prompt_tokens),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             stats.cached_tokens),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens),
            ("vllm:generation_tokens", "Number of generation tokens processed.",
             stats.completion_tokens),
        ):
            yield self._one(CounterMetricFamily(name, help_, labels=label), value)
        success = CounterMetricFamily("vllm:request_success",
                                      "Count of successfully processed requests.",
                                      labels=[*label, "finished_reason"])
        yield self._one(success, stats.success, "stop")

        ttft = stats.ttft
        cumulative = accumulate(ttft.counts[: len(ttft.buckets)])
        buckets = [(floatToGoString(b), n) for b, n in zip(ttft.buckets, cumulative, strict=True)]
        buckets.append(("+Inf", ttft.count))
        histogram = HistogramMetricFamily("vllm:time_to_first_token_seconds",
                                          "Histogram of time to first token in seconds.",
                                          labels=label)
        histogram.add_metric([self.model], buckets, sum_value=ttft.total)
        yield histogram


def render_prometheus(stats: SimStats, model: str, cache_usage: float) -> str:
    """Prometheus text exposition (by prometheus_client) with vLLM's metric names."""
    return generate_latest(_SimCollector(stats, model, cache_usage)).decode()
