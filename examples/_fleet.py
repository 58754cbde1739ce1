"""Where the distributed examples keep their state and who runs their turns.

``AGENTBATCH_REDIS_URL`` names your Redis, with ``agentbatch worker --redis-url ...`` processes
already running on any machine (they must reach the backend: the simulator an example starts
listens on 127.0.0.1, so for workers elsewhere set ``AGENTBATCH_BACKEND`` too). Unset,
``redis_and_worker`` starts a throwaway ``redis-server`` and one worker on this machine (the
redis-server binary must be installed) and stops them when the example ends.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

REDIS_ENV = "AGENTBATCH_REDIS_URL"
START_S = 60.0  # how long redis-server and the worker may take to come up


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def _wait_ready(worker: subprocess.Popen[bytes], log: str, deadline: float) -> None:
    """Until the worker logs " ready."; its log is the error if it exits or takes too long."""
    while True:
        with open(log, errors="replace") as f:
            text = f.read()
        if " ready." in text:
            return
        if worker.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the worker did not start:\n{text[-2000:]}")
        time.sleep(0.2)


@contextmanager
def redis_and_worker(concurrency: int = 8) -> Iterator[str]:
    """``AGENTBATCH_REDIS_URL``, or a redis-server and one worker (``concurrency`` task
    threads) started, and stopped, here."""
    given = os.environ.get(REDIS_ENV)
    if given:
        yield given
        return
    if shutil.which("redis-server") is None:
        raise SystemExit(f"set {REDIS_ENV}, or install redis-server to let this example "
                         "start one")
    import redis

    with ExitStack() as stack:
        workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="agentbatch-example-"))
        port = _free_port()
        server = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", workdir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        stack.callback(_stop, server)
        url = f"redis://127.0.0.1:{port}/0"
        client = redis.from_url(url)
        deadline = time.monotonic() + START_S
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("redis-server did not start") from None
                time.sleep(0.1)
        client.close()
        log = os.path.join(workdir, "worker.log")
        worker = subprocess.Popen(
            [sys.executable, "-m", "agentbatch.cli", "worker", "--redis-url", url,
             "--concurrency", str(concurrency)],
            stdout=subprocess.DEVNULL, stderr=stack.enter_context(open(log, "wb")),
            # the modules this worker may import tools and output schemas from
            env={**os.environ, "AGENTBATCH_WORKER_IMPORTS": "agentbatch.toolpool.builtins"})
        stack.callback(_stop, worker)
        _wait_ready(worker, log, deadline=time.monotonic() + START_S)
        yield url
