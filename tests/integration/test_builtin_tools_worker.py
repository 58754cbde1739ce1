"""The built-in tools on a real worker started the way systemd starts one (issue 8, 5 and 6).

A worker whose current directory is ``/`` and that has no ``AGENTBATCH_FILE_ROOT``, with a
secret in its environment: the model asks ``read_file`` for ``/proc/self/environ`` and
``/etc/shadow``, and ``http_get`` for a loopback service (the simulator's ``/metrics``) in
decimal and hex spellings. Every call must fail, nothing the service or the files hold may
reach the model, and the secret must appear nowhere in Redis (where tool results are kept).
"""

from __future__ import annotations

import json
import subprocess
import sys
from urllib.parse import urlsplit

import pytest
import redis

from agentbatch import Tool, submit_batch
from agentbatch.sim.server import SimServer
from tests.support.workers import REPO, WorkerProcess

pytestmark = [pytest.mark.redis, pytest.mark.slow]

CANARY = "canary-3f7e1d9b2a"


class RootWorker(WorkerProcess):
    """A worker whose current directory is ``/`` (systemd's default)."""

    def start(self, wait: bool = True) -> RootWorker:
        cmd = [sys.executable, "-m", "agentbatch.cli", "worker", "--concurrency", "4",
               "--redis-url", self.redis_url, "--loglevel", "INFO"]
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=self._log,
                                     stderr=subprocess.STDOUT, cwd="/")
        if wait:
            self.wait_ready()
        return self


def test_worker_started_from_slash_reads_no_secrets_and_reaches_no_loopback(
        redis_url: str, sim: SimServer, sim_url: str) -> None:
    worker = RootWorker(redis_url, env={"AGENTBATCH_TEST_SECRET": CANARY,
                                        "PYTHONPATH": str(REPO)})
    worker.env.pop("AGENTBATCH_FILE_ROOT", None)
    worker.env.pop("AGENTBATCH_HTTP_ALLOW", None)
    port = urlsplit(sim.url).port
    calls = [
        ("read_file", {"path": "proc/self/environ"}),
        ("read_file", {"path": "/proc/self/environ"}),
        ("read_file", {"path": "/etc/shadow"}),
        ("http_get", {"url": f"http://127.0.0.1:{port}/metrics"}),
        ("http_get", {"url": f"http://2130706433:{port}/metrics"}),
        ("http_get", {"url": f"http://0x7f000001:{port}/metrics"}),
    ]
    task = "Agent {i}.\n{line}"
    inputs = [{"i": i, "line": f"@sim tool {name} {_json(args)}"}
              for i, (name, args) in enumerate(calls)]
    worker.start()
    try:
        handle = submit_batch(task, inputs, tools=[Tool.read_file, Tool.http_get],
                              backend=sim_url, model="sim-model", redis_url=redis_url)
        results = handle.wait(timeout=120)
    finally:
        worker.stop(timeout=15)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    for r in results:
        [call] = r.tool_calls
        assert not call.ok, (r.index, call)  # refused: no root / not a public address
    dumped = _everything(redis.from_url(redis_url))
    assert CANARY.encode() not in dumped
    assert b"no root directory configured" in dumped  # the model was told how to set one
    # http_get's refusals are ``not call.ok`` above; their wording is checked against a real
    # loopback server in tests/unit/test_builtin_tools_confinement.py. (A plain tool's
    # outcome is kept nowhere but in the agent's conversation, which its terminal commit
    # drops.)
    assert b"vllm:" not in dumped and b"# HELP" not in dumped  # no /metrics text stored


def _json(args: dict[str, str]) -> str:
    return json.dumps(args)


def _everything(client: redis.Redis) -> bytes:
    """Every value in the database, as bytes (DUMP may compress, so read by type)."""
    out: list[bytes] = []
    for key in client.scan_iter(count=1000):
        kind = client.type(key)
        if kind == b"string":
            out.append(client.get(key) or b"")
        elif kind == b"hash":
            out.extend(k + b"=" + v for k, v in client.hgetall(key).items())
        elif kind == b"list":
            out.extend(client.lrange(key, 0, -1))
        elif kind == b"set":
            out.extend(client.smembers(key))
        elif kind == b"zset":
            out.extend(client.zrange(key, 0, -1))
        elif kind == b"stream":
            out.extend(k + b"=" + v for _, f in client.xrange(key) for k, v in f.items())
    return b"\n".join(out)
