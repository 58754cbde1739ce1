"""Counters of what the simulator did: JSON for tests (``/sim/stats``), Prometheus for engines.

The Prometheus names match vLLM's, so the engine's backpressure and cache-hit probes run
unchanged against the simulator and a real server.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

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
        }


def _num(value: float) -> str:
    return repr(float(value))


def render_prometheus(stats: SimStats, model: str, cache_usage: float) -> str:
    """Prometheus text exposition (format 0.0.4) with vLLM's metric names."""
    label = f'model_name="{model}"'
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, value: float, extra: str = "") -> None:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        lines.append(f"{name}{{{label}{extra}}} {_num(value)}")

    hit_rate = stats.cached_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0
    metric(
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        stats.running,
    )
    metric(
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        stats.waiting,
    )
    metric(
        "vllm:gpu_cache_usage_perc",
        "gauge",
        "GPU KV-cache usage. 1 means 100 percent usage.",
        cache_usage,
    )
    metric("vllm:gpu_prefix_cache_hit_rate", "gauge", "GPU prefix cache block hit rate.", hit_rate)
    metric(
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        stats.prompt_tokens,
    )
    metric(
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        stats.cached_tokens,
    )
    metric(
        "vllm:prompt_tokens_total",
        "counter",
        "Number of prefill tokens processed.",
        stats.prompt_tokens,
    )
    metric(
        "vllm:generation_tokens_total",
        "counter",
        "Number of generation tokens processed.",
        stats.completion_tokens,
    )
    metric(
        "vllm:request_success_total",
        "counter",
        "Count of successfully processed requests.",
        stats.success,
        ',finished_reason="stop"',
    )

    name = "vllm:time_to_first_token_seconds"
    lines.append(f"# HELP {name} Histogram of time to first token in seconds.")
    lines.append(f"# TYPE {name} histogram")
    cumulative = 0
    for bound, n in zip(stats.ttft.buckets, stats.ttft.counts, strict=False):
        cumulative += n
        lines.append(f'{name}_bucket{{{label},le="{bound}"}} {_num(cumulative)}')
    lines.append(f'{name}_bucket{{{label},le="+Inf"}} {_num(stats.ttft.count)}')
    lines.append(f"{name}_count{{{label}}} {_num(stats.ttft.count)}")
    lines.append(f"{name}_sum{{{label}}} {_num(stats.ttft.total)}")
    return "\n".join(lines) + "\n"
