"""Prometheus metrics for a worker process (``agentbatch_*``), served by prometheus_client.

The endpoint listens on loopback unless the operator names another interface (``agentbatch
worker --metrics-host``): metrics are not for the whole network.
"""

from __future__ import annotations

from collections.abc import Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, Metric

from .context import worker_context


class _WorkerCollector:
    """``agentbatch_events_total{event=...}`` over this process's ``worker_context().stats``."""

    def collect(self) -> Iterator[Metric]:
        events = CounterMetricFamily("agentbatch_events", "Worker events, by kind.",
                                     labels=["event"])
        for what, n in sorted(worker_context().stats.items()):
            events.add_metric([what], n)
        yield events


def registry() -> CollectorRegistry:
    """A registry holding only this worker's collector (no process or GC collectors)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_WorkerCollector())
    return reg


def render() -> bytes:
    """The Prometheus text exposition of this process's counters."""
    return generate_latest(registry())


def serve_metrics(port: int, host: str = "127.0.0.1") -> WSGIServer:
    """Serve ``/metrics`` on ``host:port`` from a daemon thread."""
    server, _thread = start_http_server(port, addr=host, registry=registry())
    return server
