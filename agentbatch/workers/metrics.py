"""Prometheus text metrics for a worker process (``agentbatch_*``), served over HTTP."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .context import worker_context


def render() -> str:
    stats = worker_context().stats
    lines = ["# TYPE agentbatch_events_total counter"]
    for what, n in sorted(stats.items()):
        lines.append(f'agentbatch_events_total{{event="{what}"}} {n}')
    return "\n".join(lines) + "\n"


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path.rstrip("/") != "/metrics":
            self.send_error(404)
            return
        body = render().encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def serve_metrics(port: int, host: str = "0.0.0.0") -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((host, port), _Handler)
    threading.Thread(target=server.serve_forever, name="agentbatch-metrics", daemon=True).start()
    return server
