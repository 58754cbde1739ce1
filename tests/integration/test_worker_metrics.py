"""A worker's Prometheus endpoint (`agentbatch worker --metrics-port`): what it serves, and
that it listens on loopback unless told otherwise ("metrics are not open to the world").

A real redis-server, a real worker process and the simulator; the exposition is read back
with prometheus_client's own parser.
"""

from __future__ import annotations

import socket
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agentbatch import submit_batch
from tests.support.tools import Answer, lookup

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening_hosts(port: int) -> set[str]:
    """Local addresses with a socket listening on ``port`` (IPv4, from /proc/net/tcp)."""
    hosts = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, _, hexport = local.partition(":")
        if state == "0A" and int(hexport, 16) == port:  # 0A: LISTEN
            hosts.add(socket.inet_ntoa(bytes.fromhex(addr)[::-1]))
    return hosts


def _events(port: int, deadline_s: float = 20) -> dict[str, float]:
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                body, ctype = resp.read().decode(), resp.headers["Content-Type"]
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    assert ctype.startswith("text/plain")
    events = {}
    for family in text_string_to_metric_families(body):
        if family.name == "agentbatch_events":
            assert family.type == "counter"
            for sample in family.samples:
                if sample.name == "agentbatch_events_total":
                    events[sample.labels["event"]] = sample.value
    return events


def test_worker_metrics_listen_on_loopback_by_default_and_count_turns(
        redis_url, sim_url, start_workers):
    port = _free_port()
    start_workers(1, concurrency=8, extra_args=["--metrics-port", str(port)])
    handle = submit_batch('Agent {i}.\n@sim tool lookup {{"key": "k{i}"}}',
                          [{"i": i} for i in range(6)], tools=[lookup], output_schema=Answer,
                          model="sim-model", backend=sim_url, redis_url=redis_url)
    assert all(r.ok for r in handle.wait(timeout=120))
    assert _listening_hosts(port) == {"127.0.0.1"}
    events = _events(port)
    assert events.get("tool_calls", 0) >= 6, events


def test_worker_metrics_listen_where_metrics_host_says(redis_url, start_workers):
    port = _free_port()
    start_workers(1, concurrency=2,
                  extra_args=["--metrics-port", str(port), "--metrics-host", "0.0.0.0"])
    _events(port)  # serving
    assert _listening_hosts(port) == {"0.0.0.0"}
