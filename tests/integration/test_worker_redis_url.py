"""How `agentbatch worker` gets its Redis URL (issue 8, item 12).

The URL carries the Redis password, and everything a worker runs (tools, their subprocesses)
can read its environment, so the worker must not copy ``--redis-url`` into ``os.environ``;
``--redis-url-file`` keeps the password off the command line too. ``unix://`` URLs work end
to end. Real redis-servers (one with a password, one on a unix socket), real worker
processes and the simulator.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from agentbatch import submit_batch
from tests.support.env_probe import environ_leak
from tests.support.redis_server import RedisServer
from tests.support.tools import Answer, cached_lookup, lookup
from tests.support.workers import WorkerProcess

pytestmark = [pytest.mark.redis, pytest.mark.slow]

PASSWORD = "pw-3c1e9a7f5b"  # unlikely to appear in anyone's environment by chance


class UrlWorker(WorkerProcess):
    """A worker given its URL by ``url_args`` and, unless ``url_in_env``, no
    ``AGENTBATCH_REDIS_URL`` in its environment."""

    def __init__(self, url_args: list[str], *, url_in_env: str | None = None) -> None:
        super().__init__("unused", name="url", concurrency=4)
        self.env.pop("AGENTBATCH_REDIS_URL")
        if url_in_env is not None:
            self.env["AGENTBATCH_REDIS_URL"] = url_in_env
        self.url_args = url_args

    def start(self, wait: bool = True) -> UrlWorker:
        cmd = [sys.executable, "-m", "agentbatch.cli", "worker", *self.url_args,
               "--concurrency", "4", "--loglevel", "INFO"]
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=self._log,
                                     stderr=subprocess.STDOUT, cwd=Path(__file__).parents[2])
        if wait:
            self.wait_ready()
        return self


@pytest.fixture
def password_redis() -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not installed (.ci/run installs it)")
    server = RedisServer(password=PASSWORD).start()
    yield server
    server.cleanup()


def _tool_saw_password(url: str, worker: UrlWorker, sim_url: str) -> bool:
    """Run one agent whose tool fails if the password shows in the worker's environment."""
    task = f'Agent {{i}}.\n@sim tool environ_leak {{{{"needle": "{PASSWORD}"}}}}'
    try:
        handle = submit_batch(task, [{"i": 0}], tools=[environ_leak], backend=sim_url,
                              model="sim-model", output_schema=Answer, redis_url=url)
        [result] = handle.wait(timeout=120)
        assert result.ok, result.error
        [call] = result.tool_calls
        return not call.ok
    finally:
        worker.stop(timeout=15)


def test_redis_url_option_is_not_copied_into_the_environment(
        password_redis: RedisServer, sim_url: str) -> None:
    url = password_redis.url
    worker = UrlWorker(["--redis-url", url]).start()
    assert not _tool_saw_password(url, worker, sim_url)


def test_redis_url_file_keeps_the_password_off_the_command_line(
        password_redis: RedisServer, sim_url: str, tmp_path: Path) -> None:
    url_file = tmp_path / "redis-url"
    url_file.write_text(password_redis.url + "\n")
    url_file.chmod(0o600)
    worker = UrlWorker(["--redis-url-file", str(url_file)]).start()
    assert worker.proc is not None
    cmdline = Path(f"/proc/{worker.proc.pid}/cmdline").read_bytes()
    assert PASSWORD.encode() not in cmdline
    assert not _tool_saw_password(password_redis.url, worker, sim_url)


@pytest.fixture
def unix_redis() -> Iterator[str]:
    """A redis-server listening only on a unix socket; yields its unix:// URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server binary not installed (.ci/run installs it)")
    # A short path: a unix socket's path is limited to about 100 bytes.
    workdir = Path(tempfile.mkdtemp(prefix="ab-unix-", dir="/tmp"))
    sock = workdir / "redis.sock"
    proc = subprocess.Popen([binary, "--port", "0", "--unixsocket", str(sock),
                             "--unixsocketperm", "700", "--dir", str(workdir), "--save", "",
                             "--appendonly", "no", "--logfile", str(workdir / "redis.log")])
    url = f"unix://{sock}?db=0"
    deadline = time.monotonic() + 10
    while True:
        try:
            redis.from_url(url, socket_connect_timeout=0.2).ping()
            break
        except (redis.ConnectionError, FileNotFoundError):
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("redis-server on a unix socket did not start") from None
            time.sleep(0.05)
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        shutil.rmtree(workdir, ignore_errors=True)


def test_a_batch_with_tools_runs_over_a_unix_socket(unix_redis: str, sim_url: str) -> None:
    # The test tools count their executions through AGENTBATCH_REDIS_URL.
    worker = UrlWorker(["--redis-url", unix_redis], url_in_env=unix_redis).start()
    try:
        handle = submit_batch('Agent {i}.\n@sim tool lookup {{"key": "k{i}"}}\n'
                              '@sim tool cached_lookup {{"key": "shared"}}',
                              [{"i": i} for i in range(6)], tools=[lookup, cached_lookup],
                              backend=sim_url, model="sim-model", output_schema=Answer,
                              redis_url=unix_redis)
        results = handle.wait(timeout=120)
        assert [r.index for r in results] == list(range(6))
        assert all(r.ok for r in results), [r.error for r in results if not r.ok]
        assert handle.status().get("done") == 6, handle.status()
    finally:
        worker.stop(timeout=15)
    client = redis.from_url(unix_redis)
    assert int(client.get("test:exec:cached_lookup:shared")) == 1  # one batch: shared once
    assert sum(int(client.get(f"test:exec:lookup:k{i}")) for i in range(6)) == 6
    assert worker.proc is not None and worker.proc.returncode == 0
