"""A worker's Prometheus endpoint (``agentbatch worker --metrics-port``).

It serves agentbatch's metrics (``agentbatch.metrics``: turns, tokens, latency, tools, events)
and the queue depths and agents by state read from Redis at scrape time. The endpoint
listens on loopback unless the operator names another interface (``--metrics-host``).

Under ``--pool prefork`` every child process records into files under a directory made here
before Celery forks (prometheus_client's multiprocess mode); the server, in the parent,
sums them, and a child's live gauges are dropped when it exits.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from typing import Any

from celery import signals

from agentbatch.metrics.server import MULTIPROC_ENV, enable_multiprocess, mark_process_dead, serve


def prepare_prefork() -> None:
    """Multiprocess mode, before the pool forks: ``PROMETHEUS_MULTIPROC_DIR`` as given, else
    a fresh directory removed when the worker exits."""
    path = os.environ.get(MULTIPROC_ENV)
    if not path:
        path = tempfile.mkdtemp(prefix="agentbatch-metrics-")
        atexit.register(shutil.rmtree, path, True)
    enable_multiprocess(path)
    signals.worker_process_shutdown.connect(_child_exited, weak=False)


def _child_exited(pid: int | None = None, **_: Any) -> None:
    """Celery runs this in a prefork child as it exits."""
    mark_process_dead(pid or os.getpid())


def serve_metrics(port: int, host: str = "127.0.0.1", redis_url: str | None = None) -> Any:
    """Serve ``/metrics`` on ``host:port`` from a daemon thread; ``MetricsPortInUse`` (naming
    the port) when another process holds it."""
    from agentbatch.distributed.queue_gauges import RedisGauges

    extra = [RedisGauges(redis_url)] if redis_url else []
    return serve(port, host, extra, param="--metrics-port")
