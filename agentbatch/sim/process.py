"""The simulator as a separate OS process, so its CPU does not compete with the caller's GIL."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import replace
from typing import IO, Any

from agentbatch.sim.config import SimConfig, config_to_argv


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to 0, read it, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class SimProcess:
    """Run ``python -m agentbatch.sim`` and wait for ``/health``; same interface as SimServer.

    ``with SimProcess(SimConfig(max_running=32)) as sim: ... sim.url``
    """

    def __init__(
        self,
        config: SimConfig | None = None,
        /,
        *,
        python: str = sys.executable,
        startup_timeout_s: float = 30.0,
        **overrides: Any,
    ) -> None:
        self.config = replace(config or SimConfig(), **overrides)
        self.python = python
        self.startup_timeout_s = startup_timeout_s
        self.port: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("SimProcess is not started")
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "") else self.config.host
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def start(self) -> SimProcess:
        if self.proc is not None:
            return self
        self.port = self.config.port or free_port(self.config.host)
        argv = config_to_argv(replace(self.config, port=self.port))
        # A file, not a pipe: a chatty child can never block on a full pipe buffer.
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [self.python, "-m", "agentbatch.sim", *argv],
            stdout=subprocess.DEVNULL,
            stderr=self._log,
        )
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _output(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read().decode("utf-8", "replace")[-4000:]

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"agentbatch sim exited with code {self.proc.returncode} "
                    f"before becoming healthy; stderr:\n{self._output()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1.0) as resp:
                    if resp.status == 200:
                        return
            except (OSError, ValueError):  # refused / not yet listening / odd port
                pass
            time.sleep(0.05)
        raise RuntimeError(
            f"agentbatch sim at {self.url} not healthy after "
            f"{self.startup_timeout_s}s; stderr:\n{self._output()}"
        )

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            self.proc = None
        if self._log is not None:
            with contextlib.suppress(OSError):
                self._log.close()
            self._log = None
        self.port = None

    def __enter__(self) -> SimProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
