"""Real `agentbatch worker` processes for distributed tests, started through the CLI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.support.scratch import scratch_file

REPO = Path(__file__).resolve().parents[2]


class WorkerProcess:
    def __init__(self, redis_url: str, *, queues: str = "inference,tools", concurrency: int = 8,
                 name: str = "w", env: dict[str, str] | None = None,
                 pool: str = "threads", supervise: bool = False,
                 loglevel: str = "INFO", extra_args: list[str] | None = None) -> None:
        self.redis_url = redis_url
        self.extra_args = list(extra_args or [])
        self.loglevel = loglevel
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
            "AGENTBATCH_WORKER_IMPORTS": "tests.support,agentbatch.toolpool.builtins",
            **(env or {}),
        }
        self.log_path = scratch_file(f"worker-{name}-", ".log")
        self.proc: subprocess.Popen[bytes] | None = None
        # like compose/k8s restart policies: a worker that exits is started again
        self.supervise = supervise
        self.restarts = 0
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None

    def start(self, wait: bool = True) -> WorkerProcess:
        cmd = [sys.executable, "-m", "agentbatch.cli", "worker", "--queues", self.queues,
               "--concurrency", str(self.concurrency), "--redis-url", self.redis_url,
               "--pool", self.pool, "--hostname", f"{self.name}-{os.getpid()}@%h",
               "--loglevel", self.loglevel, *self.extra_args]
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=REPO)
        if wait:
            self.wait_ready()
        if self.supervise and self._supervisor is None:
            self._supervisor = threading.Thread(target=self._watch, daemon=True)
            self._supervisor.start()
        return self

    def _watch(self) -> None:
        while not self._stopping.wait(0.5):
            if self.proc is not None and self.proc.poll() is not None:
                self.restarts += 1
                self.start(wait=False)

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
        self._stopping.set()
        if self.alive:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self, timeout: float = 30) -> None:
        self._stopping.set()
        if self.alive:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
