"""Real `agentbatch worker` processes for distributed tests, started through the CLI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class WorkerProcess:
    def __init__(self, redis_url: str, *, queues: str = "inference,tools", concurrency: int = 8,
                 name: str = "w", env: dict[str, str] | None = None,
                 pool: str = "threads") -> None:
        self.redis_url = redis_url
        self.queues = queues
        self.concurrency = concurrency
        self.name = name
        self.pool = pool
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "AGENTBATCH_REDIS_URL": redis_url,
            "AGENTBATCH_SWEEP_INTERVAL_S": "0.5",
            "AGENTBATCH_LEASE_TTL_S": "3",
            "AGENTBATCH_QUEUE_GRACE_S": "5",
            **(env or {}),
        }
        self.log_path = Path(tempfile.mkstemp(prefix=f"agentbatch-{name}-", suffix=".log")[1])
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, wait: bool = True) -> WorkerProcess:
        cmd = [sys.executable, "-m", "agentbatch.cli", "worker", "--queues", self.queues,
               "--concurrency", str(self.concurrency), "--redis-url", self.redis_url,
               "--pool", self.pool, "--hostname", f"{self.name}-{os.getpid()}@%h",
               "--loglevel", "INFO"]
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=REPO)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if " ready." in self.log():
                return
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited: {self.log()[-3000:]}")
            time.sleep(0.1)
        raise TimeoutError(f"worker {self.name} not ready: {self.log()[-3000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.alive:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self, timeout: float = 30) -> None:
        if self.alive:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
