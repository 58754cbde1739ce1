"""The ``/metrics`` HTTP endpoint (prometheus_client's), for workers and the embedded engine.

It listens on 127.0.0.1 unless told otherwise: metrics are not for the whole network. Under
Celery's prefork pool the values live in ``PROMETHEUS_MULTIPROC_DIR`` (one file per child),
and the server sums them with a ``MultiProcessCollector``.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterable
from typing import Any

from agentbatch.core.errors import BatchSpecError, ConfigError
from agentbatch.metrics import created, metrics

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


class MetricsPortInUse(ConfigError):
    """The metrics port is taken by another process."""


def enable_multiprocess(path: str) -> None:
    """Keep metric values in files under ``path`` (prefork: set before any child forks).

    prometheus_client picks its value class when it is first imported; it is picked again
    here in case something imported it before, and the metric objects must not exist yet."""
    if created():
        raise RuntimeError("agentbatch metrics were created before multiprocess mode was set")
    os.environ[MULTIPROC_ENV] = path
    from prometheus_client import values

    values.ValueClass = values.get_value_class()


def mark_process_dead(pid: int) -> None:
    """Drop a dead child's live gauges (its in-flight calls are no longer in flight)."""
    from prometheus_client import multiprocess

    if os.environ.get(MULTIPROC_ENV):
        multiprocess.mark_process_dead(pid)


class _Own:
    """This process's metric objects as one collector (the registry stays ours alone)."""

    def collect(self) -> Iterable[Any]:
        return metrics().registry.collect()


def build_registry(extra: Iterable[Any] = ()) -> Any:
    """The registry a server serves: agentbatch's metrics (every prefork child's, summed, in
    multiprocess mode) plus ``extra`` collectors read at scrape time."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    reg = CollectorRegistry(auto_describe=False)
    path = os.environ.get(MULTIPROC_ENV)
    if path:
        MultiProcessCollector(reg, path=path)
    else:
        reg.register(_Own())
    for collector in extra:
        reg.register(collector)
    return reg


_servers: dict[tuple[str, int], Any] = {}
_servers_lock = threading.Lock()


def serve(port: int, host: str = "127.0.0.1", extra: Iterable[Any] = (),
          param: str = "metrics_port") -> Any:
    """Serve ``/metrics`` on ``host:port`` from a daemon thread, once per process and address
    (a second call for the same address reuses the first server). A port another process
    holds raises ``MetricsPortInUse`` naming it and ``param``."""
    from prometheus_client import start_http_server

    with _servers_lock:
        server = _servers.get((host, port))
        if server is not None:
            return server
        try:
            server, _thread = start_http_server(port, addr=host,
                                                registry=build_registry(extra))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise MetricsPortInUse(
                    f"{param}: port {port} on {host} is already in use; choose a free port "
                    "for metrics") from None
            raise ConfigError(f"{param}: cannot listen on {host}:{port} ({exc})") from None
        _servers[(host, port)] = server
        return server


HOST_ENV = "AGENTBATCH_METRICS_HOST"


def check_metrics_port(port: object, redis_url: str | None) -> None:
    """``metrics_port`` of a batch: a port number, and only on the embedded engine."""
    if port is None:
        return
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise BatchSpecError(f"metrics_port must be a port number (1-65535) or None, got "
                             f"{port!r}")
    if redis_url:
        raise BatchSpecError(
            "metrics_port is for the embedded engine; on the distributed engine (redis_url=...) "
            "each worker exports the metrics itself: start it with `agentbatch worker "
            "--metrics-port PORT` (docs/metrics.md)")
