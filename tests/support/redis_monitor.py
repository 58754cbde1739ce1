"""Record what a real redis-server runs (commands inside Lua scripts included) with MONITOR.

Tests and ``benchmarks/bench_state_bytes.py`` use it to count what a transition writes.
"""

from __future__ import annotations

import re
import threading
from types import TracebackType

import redis

_ARG = re.compile(rb'"((?:[^"\\]|\\.)*)"')
_ESC = re.compile(rb"\\(x[0-9a-fA-F]{2}|.)")
_SIMPLE = {b"n": b"\n", b"r": b"\r", b"t": b"\t", b"a": b"\a", b"b": b"\b"}


def _unescape(raw: bytes) -> bytes:
    def one(m: re.Match[bytes]) -> bytes:
        s = m.group(1)
        if s[:1] == b"x":
            return bytes([int(s[1:], 16)])
        return _SIMPLE.get(s, s)

    return _ESC.sub(one, raw)


def parse_monitor_line(line: bytes) -> list[bytes]:
    """The command's arguments from one raw MONITOR line (``ts [db client] "CMD" "arg" ...``)."""
    body = line.split(b"]", 1)[1] if b"]" in line else line
    return [_unescape(a) for a in _ARG.findall(body)]


class MonitorRecorder:
    """While the ``with`` block runs, every command the server runs, as its argument list
    (``commands``). Leaving the block waits ``settle_s`` for the last lines to arrive."""

    def __init__(self, url: str, settle_s: float = 0.5) -> None:
        self.url = url
        self.settle_s = settle_s
        self.commands: list[list[bytes]] = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)

    def _read(self) -> None:
        client = redis.Redis.from_url(self.url)
        conn = client.connection_pool.make_connection()  # its own: MONITOR keeps it
        try:
            conn.send_command("MONITOR")
            conn.read_response()
            self._ready.set()
            while not self._stop.is_set():
                if conn.can_read(timeout=0.2):
                    raw = conn.read_response()
                    line = raw if isinstance(raw, bytes) else str(raw).encode()
                    self.commands.append(parse_monitor_line(line))
        finally:
            conn.disconnect()
            client.close()

    def __enter__(self) -> MonitorRecorder:
        self._thread.start()
        if not self._ready.wait(10):
            raise TimeoutError("MONITOR did not start within 10 s")
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.wait(self.settle_s)
        self._stop.set()
        self._thread.join(5)
