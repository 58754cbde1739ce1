"""The distributed engine: agent state in Redis, turns run by ``agentbatch worker`` processes.

    AGENTBATCH_REDIS_URL=redis://host:6379/0 python examples/distributed.py

with workers already running (``agentbatch worker --redis-url ...`` on any machine). Unset,
this example starts a throwaway ``redis-server`` and one worker itself (the redis-server binary
must be installed). The submitter may leave: ``get_batch(batch_id)`` re-attaches from anywhere.
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

from _backend import MODEL, backend_url, sim_hint

from agentbatch import get_batch, submit_batch

DEADLINE_S = 60.0


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
def redis_and_worker() -> Iterator[str]:
    """``AGENTBATCH_REDIS_URL``, or a redis-server and one worker started (and stopped) here."""
    given = os.environ.get("AGENTBATCH_REDIS_URL")
    if given:
        yield given
        return
    if shutil.which("redis-server") is None:
        raise SystemExit("set AGENTBATCH_REDIS_URL, or install redis-server to let this "
                         "example start one")
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
        deadline = time.monotonic() + DEADLINE_S
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
             "--concurrency", "8"],
            stdout=subprocess.DEVNULL, stderr=stack.enter_context(open(log, "wb")),
            # the modules this worker may import tools and output schemas from
            env={**os.environ, "AGENTBATCH_WORKER_IMPORTS": "agentbatch.toolpool.builtins"})
        stack.callback(_stop, worker)
        _wait_ready(worker, log, deadline=time.monotonic() + DEADLINE_S)
        yield url


def main() -> int:
    task = "Write one line about city #{n}." + sim_hint("answer city-{n} is lovely") + "\n"
    with backend_url() as backend, redis_and_worker() as redis_url:
        handle = submit_batch(task, [{"n": i} for i in range(20)], model=MODEL,
                              backend=backend, redis_url=redis_url, max_turns=2)
        print("submitted", handle.batch_id)
        # Any process can re-attach to the batch by id and read its results.
        again = get_batch(handle.batch_id, redis_url=redis_url)
        results = again.wait(timeout=DEADLINE_S)
        print(again.status())
    for r in results[:5]:
        print(r.index, r.text if r.ok else r.error)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
