"""Issue 8, item 11: ``agentbatch flower`` is not open by default.

The real command against a real (password-protected) redis-server: it answers 401 without
credentials and 200 with them, listens on 127.0.0.1 only, keeps the Redis password out of
every command line, and refuses to start with no auth choice or no broker URL. Before the
fix there was no such command; the README's ``celery -A agentbatch.distributed.workers
flower`` had no auth, listened on every interface and silently watched ``redis://127.0.0.1:6379``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from tests.support.redis_server import RedisServer, free_port
from tests.support.workers import REPO

pytestmark = [pytest.mark.redis, pytest.mark.slow]

REDIS_PASSWORD = "flower-test-redis-pw-7f3a"
USER, PASSWORD = "admin", "flower-ui-pw-91c2"


def _env(redis_url: str | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("FLOWER_") and k != "AGENTBATCH_REDIS_URL"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    if redis_url is not None:
        env["AGENTBATCH_REDIS_URL"] = redis_url
    return {**env, **extra}


def _command(*args: str) -> list[str]:
    return [sys.executable, "-m", "agentbatch.cli", "flower", *args]


class Flower:
    """A running ``agentbatch flower`` on a free port; stopped by ``stop``."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.port = free_port()
        self.log_path = Path(tempfile.mkstemp(prefix="agentbatch-flower-cli-", suffix=".log")[1])
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(_command("--port", str(self.port), *args), env=env,
                                     cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"flower exited {self.proc.returncode}: {self.log()}")
            try:
                if httpx.get(self.url + "/healthcheck", timeout=1).text == "OK":
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"flower not healthy: {self.log()}")
            time.sleep(0.2)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)
        self._log.close()
        self.log_path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def redis_with_password() -> Iterator[RedisServer]:
    import shutil

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not installed (.ci/run installs it)")
    server = RedisServer(password=REDIS_PASSWORD).start()
    yield server
    server.cleanup()


@pytest.fixture(scope="module")
def flower(redis_with_password: RedisServer) -> Iterator[Flower]:
    """Started as the README says, the Redis URL (with its password) from the environment."""
    proc = Flower(["--basic-auth", f"{USER}:{PASSWORD}"], _env(redis_with_password.url))
    yield proc
    proc.stop()


def _listening_addresses(port: int) -> set[str]:
    """Local addresses of LISTEN sockets on ``port``, from /proc/net/tcp{,6}."""
    found = set()
    for name in ("tcp", "tcp6"):
        path = Path("/proc/net") / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:
                if len(address) == 8:
                    found.add(socket.inet_ntoa(bytes.fromhex(address)[::-1]))
                else:
                    found.add(address)
    return found


def test_the_ui_and_api_need_the_credentials(flower):
    for path in ("/", "/workers", "/tasks", "/broker", "/api/workers", "/api/tasks"):
        assert httpx.get(flower.url + path, timeout=30).status_code == 401, path
        wrong = httpx.get(flower.url + path, auth=(USER, "nope"), timeout=30)
        assert wrong.status_code == 401, path
    for path in ("/", "/tasks", "/api/tasks"):
        reply = httpx.get(flower.url + path, auth=(USER, PASSWORD), timeout=30)
        assert reply.status_code == 200, (path, reply.status_code, flower.log())

def test_it_watches_the_given_broker_and_never_shows_its_password(flower,
                                                                  redis_with_password):
    client = redis.from_url(redis_with_password.url)
    client.delete("inference")
    client.lpush("inference", "waiting-1", "waiting-2")  # two messages no worker takes
    try:
        lengths = httpx.get(flower.url + "/api/queues/length", auth=(USER, PASSWORD),
                            timeout=30)
        assert lengths.status_code == 200, flower.log()
        queues = {q["name"]: q["messages"] for q in lengths.json()["active_queues"]}
        assert queues["inference"] == 2, queues
        broker = httpx.get(flower.url + "/broker", auth=(USER, PASSWORD), timeout=30)
        assert broker.status_code == 200, flower.log()
        assert f"redis://:**@127.0.0.1:{redis_with_password.port}/0" in broker.text
        assert REDIS_PASSWORD not in broker.text
    finally:
        client.delete("inference")


def test_it_listens_on_loopback_only(flower):
    assert _listening_addresses(flower.port) == {"127.0.0.1"}
    with socket.socket() as s:  # another loopback address reaches no listener
        s.settimeout(5)
        assert s.connect_ex(("127.0.0.2", flower.port)) != 0


def test_no_secret_on_any_command_line(flower):
    cmdline = Path(f"/proc/{flower.proc.pid}/cmdline").read_bytes().decode()
    assert REDIS_PASSWORD not in cmdline and "redis://" not in cmdline, cmdline
    children = subprocess.run(["ps", "-o", "args=", "--ppid", str(flower.proc.pid)],
                              capture_output=True, text=True, timeout=30).stdout
    assert REDIS_PASSWORD not in children and PASSWORD not in children, children
    assert REDIS_PASSWORD not in flower.log()


def test_it_refuses_to_start_without_an_auth_choice(redis_with_password):
    port = free_port()
    out = subprocess.run(_command("--port", str(port)), env=_env(redis_with_password.url),
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "--basic-auth" in out.stderr and "--no-auth" in out.stderr, out.stderr
    assert _listening_addresses(port) == set()
    # the two choices at once are refused too
    out = subprocess.run(_command("--port", str(port), "--no-auth"), cwd=REPO,
                         env=_env(redis_with_password.url, FLOWER_BASIC_AUTH="a:b"),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "contradicts" in out.stderr, out.stderr
    # a credential with an empty password is not a credential
    out = subprocess.run(_command("--port", str(port), "--basic-auth", "admin:"), cwd=REPO,
                         env=_env(redis_with_password.url), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "user:password" in out.stderr, out.stderr


def test_it_refuses_to_start_without_a_broker_url():
    port = free_port()
    out = subprocess.run(_command("--port", str(port), "--basic-auth", "a:b"), env=_env(None),
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "AGENTBATCH_REDIS_URL" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert _listening_addresses(port) == set()
    out = subprocess.run(_command("--port", str(port), "--basic-auth", "a:b", "--redis-url",
                                  "localhost:6379"), env=_env(None), cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "not a Redis URL" in out.stderr, out.stderr


def test_no_auth_must_be_explicit_and_then_the_ui_is_open(redis_with_password):
    proc = Flower(["--no-auth"], _env(redis_with_password.url))
    try:
        assert httpx.get(proc.url + "/", timeout=30).status_code == 200
        assert _listening_addresses(proc.port) == {"127.0.0.1"}
        assert "no authentication" in proc.log()
    finally:
        proc.stop()
