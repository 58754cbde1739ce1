"""Prometheus text parsing (via ``prometheus_client``) and the server-load view built on it.

The engines only need a handful of gauges (running / waiting requests, prefix-cache hit rate)
from vLLM, SGLang, Dynamo or llama.cpp. Metric names differ between servers *and* between vLLM
versions; ``parse_server_load`` knows them all and sums over label sets (several engines or
models behind one endpoint).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from agentbatch.backends.base import ServerLoad

# What prometheus_client's parser raises on a malformed line (IndexError on some label sets).
_PARSE_ERRORS = (ValueError, IndexError)


@dataclass(frozen=True)
class Sample:
    """One sample line: ``name{labels} value``."""

    name: str
    value: float
    labels: dict[str, str] = field(default_factory=dict)


def _samples(text: str) -> list[Sample]:
    """Every sample of ``text``; raises as prometheus_client does on a malformed line."""
    return [
        Sample(name=s.name, value=float(s.value), labels=dict(s.labels))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def _samples_by_line(text: str) -> list[Sample]:
    """The samples of each line parsed on its own; the lines the parser rejects are skipped."""
    samples: list[Sample] = []
    for line in text.splitlines():
        try:
            samples.extend(_samples(line))
        except _PARSE_ERRORS:
            continue
    return samples


def parse_prometheus(text: str) -> list[Sample]:
    """All samples in a Prometheus text exposition, parsed by ``prometheus_client``.

    Names are as exposed (a counter keeps its ``_total``; one typed ``counter`` but exposed
    without it gets ``_total`` from the parser, which ``metric_sum`` treats alike). ``*_created``
    series (counter creation timestamps, which would otherwise be summed as if they were
    values) are dropped. Never raises on a malformed body: prometheus_client gives up on the
    whole body at the first bad line, so the body is then parsed again one line at a time
    (without its ``# TYPE``, so every name is exactly as exposed) and the bad lines skipped.
    """
    try:
        samples = _samples(text)
    except _PARSE_ERRORS:
        samples = _samples_by_line(text)
    return [s for s in samples if not s.name.endswith("_created")]


def _values(samples: Iterable[Sample], name: str) -> list[float]:
    """Finite values of ``name``; a counter may be exposed with or without ``_total``."""
    names = {name, name[: -len("_total")] if name.endswith("_total") else name + "_total"}
    return [s.value for s in samples if s.name in names and math.isfinite(s.value)]


def metric_sum(samples: list[Sample], *names: str) -> float | None:
    """Sum over label sets of the first of ``names`` present; None if none is."""
    for name in names:
        values = _values(samples, name)
        if values:
            return float(sum(values))
    return None


def metric_mean(samples: list[Sample], *names: str) -> float | None:
    """Mean over label sets (for ratios such as a hit-rate gauge, which must not be summed)."""
    for name in names:
        values = _values(samples, name)
        if values:
            return float(sum(values) / len(values))
    return None


@dataclass(frozen=True)
class PrefixCounters:
    """Cumulative prefix-cache counters from one scrape, kept to compute a recent rate."""

    hits: float
    queries: float


# llama.cpp: busy slots, and tasks deferred because no slot was free (its queue).
_RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs", "llamacpp:requests_processing")
_WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs", "llamacpp:requests_deferred")
_HIT_RATE_GAUGES = ("vllm:gpu_prefix_cache_hit_rate", "sglang:cache_hit_rate")
_HIT_COUNTERS = (
    ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
    ("vllm:gpu_prefix_cache_hits_total", "vllm:gpu_prefix_cache_queries_total"),
)
# llama.cpp counts prompt tokens reused from its cache apart from those it computed.
_LLAMACPP_CACHED = "llamacpp:prompt_tokens_cached_total"
_LLAMACPP_COMPUTED = "llamacpp:prompt_tokens_total"
# Dynamo's frontend counts queued requests inside its in-flight gauge.
_DYNAMO_INFLIGHT = "dynamo_frontend_inflight_requests"
_DYNAMO_QUEUED = "dynamo_frontend_queued_requests"


def _clamp01(x: float) -> float:
    return min(1.0, max(0.0, x))


def parse_server_load(
    text: str, previous: PrefixCounters | None = None
) -> tuple[ServerLoad | None, PrefixCounters | None]:
    """Server load from a /metrics body; ``(None, None)`` when no known metric is present.

    With vLLM's cumulative hit/query counters, the hit rate is computed over the interval
    since ``previous`` (the counters returned by the last call) so it tracks the current
    workload; on the first scrape, or after a counter reset, it is the lifetime rate.
    """
    samples = parse_prometheus(text)
    running = metric_sum(samples, *_RUNNING)
    waiting = metric_sum(samples, *_WAITING)
    if running is None and waiting is None:
        inflight = metric_sum(samples, _DYNAMO_INFLIGHT)
        queued = metric_sum(samples, _DYNAMO_QUEUED)
        if inflight is not None or queued is not None:
            waiting = queued or 0.0
            running = max(0.0, (inflight or 0.0) - waiting)

    queue_known = running is not None or waiting is not None
    counters: PrefixCounters | None = None
    hit_rate: float | None = None
    for hits, queries in _hit_counters(samples):
        if hits is not None and queries is not None:
            counters = PrefixCounters(hits=hits, queries=queries)
            d_hits, d_queries = hits, queries
            # Use the interval since the last scrape when it saw new queries and no reset.
            if previous is not None and queries > previous.queries and hits >= previous.hits:
                d_hits, d_queries = hits - previous.hits, queries - previous.queries
            if d_queries > 0:
                hit_rate = _clamp01(d_hits / d_queries)
            break
    if hit_rate is None:
        gauge = metric_mean(samples, *_HIT_RATE_GAUGES)
        if gauge is not None:
            hit_rate = _clamp01(gauge)

    if running is None and waiting is None and hit_rate is None:
        return None, counters
    load = ServerLoad(
        running=running or 0.0, waiting=waiting or 0.0, prefix_cache_hit_rate=hit_rate,
        queue_known=queue_known,
    )
    return load, counters


def _hit_counters(samples: list[Sample]) -> Iterable[tuple[float | None, float | None]]:
    """Cumulative (hits, queries) candidates in the order vLLM versions and llama.cpp name them."""
    for hits_name, queries_name in _HIT_COUNTERS:
        yield metric_sum(samples, hits_name), metric_sum(samples, queries_name)
    cached = metric_sum(samples, _LLAMACPP_CACHED)
    computed = metric_sum(samples, _LLAMACPP_COMPUTED)
    yield cached, (None if cached is None or computed is None else cached + computed)
