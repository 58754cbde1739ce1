"""A throwaway redis-server on a free port with its own temp dir (never the shared :6379)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

from tests.support.scratch import scratch_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, *, appendonly: bool = False, password: str | None = None,
                 port: int | None = None, data_dir: Path | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (Debian package: redis-server)")
        self.binary = binary
        self.port = port or free_port()
        self.password = password
        self.appendonly = appendonly
        self.dir = data_dir or scratch_dir("redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.dir), "--save", "",
                "--appendonly", "yes" if self.appendonly else "no",
                "--appendfsync", "everysec", "--maxmemory-policy", "noeviction",
                "--logfile", str(self.dir / "redis.log")]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args)
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.from_url(self.url, socket_connect_timeout=0.2).ping()
                return self
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server did not start; log: {self.log()}") \
                        from None
                time.sleep(0.05)

    def log(self) -> str:
        path = self.dir / "redis.log"
        return path.read_text()[-2000:] if path.exists() else ""

    def kill(self) -> None:
        """SIGKILL: no shutdown save, exactly like a crashed node."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
