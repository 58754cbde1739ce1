"""What a new user tripped on (issue 25, item 7), each checked the way the user met it: the
`agentbatch` command as a subprocess, real redis-server, real worker processes."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from agentbatch import Tool, run_batch, submit_batch
from tests.support.redis_server import RedisServer
from tests.support.workers import REPO

pytestmark = [pytest.mark.redis]

ENV = {**os.environ, "PYTHONPATH": str(REPO)}
ENV.pop("AGENTBATCH_REDIS_URL", None)


def _cli(*args: str, env: dict[str, str] | None = None,
         timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agentbatch.cli", *args], cwd=REPO,
                          env={**ENV, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)


def _commands() -> list[list[str]]:
    """Every command path of `agentbatch`, from the click tree typer builds."""
    import typer.main

    from agentbatch.cli import app

    found: list[list[str]] = []

    def walk(cmd: object, path: list[str]) -> None:
        found.append(path)
        for name, sub in (getattr(cmd, "commands", None) or {}).items():
            walk(sub, [*path, name])

    walk(typer.main.get_command(app), [])
    return found


def test_no_help_shows_a_type_after_a_flag() -> None:
    """`--force <bool>` read as if the flag took a value."""
    commands = _commands()
    assert ["ls"] in commands and ["engine", "install"] in commands
    skipped = {("sim",), ("bench",), ("chaos",)}  # pass their arguments on, help included
    seen = 0
    for path in commands:
        if tuple(path) in skipped:
            continue
        proc = _cli(*path, "--help", env={"COLUMNS": "100"})
        assert proc.returncode == 0, (path, proc.stderr)
        assert "<bool>" not in proc.stdout, (path, proc.stdout)
        assert "--help" in proc.stdout
        seen += 1
    assert seen >= 10


@pytest.fixture
def finished_batch(redis_url: str, sim_url: str, start_workers) -> str:
    start_workers(1)
    handle = submit_batch("Say hi to {who}.", [{"who": "a"}, {"who": "b"}], backend=sim_url,
                          model="sim-model", redis_url=redis_url)
    assert all(r.ok for r in handle.wait(timeout=120))
    return handle.batch_id


def test_ls_at_80_columns_keeps_batch_ids_whole(redis_url: str, finished_batch: str) -> None:
    proc = _cli("ls", "--redis-url", redis_url, env={"COLUMNS": "80"})
    assert proc.returncode == 0, proc.stderr
    assert max(len(line) for line in proc.stdout.splitlines()) <= 80, proc.stdout
    assert finished_batch in proc.stdout, proc.stdout  # one piece, copyable into `status`


def test_status_shows_the_state_apart_from_the_counts(redis_url: str,
                                                      finished_batch: str) -> None:
    proc = _cli("status", finished_batch, "--redis-url", redis_url, env={"COLUMNS": "100"})
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert not re.search(r"finished\s*│\s*\d", out), out  # a state is not a count
    assert re.search(rf"batch {finished_batch}: finished", out), out
    assert re.search(r"delivered\s*│\s*2 / 2", out), out


@pytest.mark.parametrize("engine", ["embedded", "distributed"])
def test_tool_call_record_says_why_read_file_refused(
        engine: str, tmp_path: Path, redis_url: str, sim_url: str, start_workers,
        monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "docs"
    root.mkdir()
    (tmp_path / "secret.txt").write_text("not yours")
    task = "Read it.\n@sim tool read_file {{\"path\": \"../secret.txt\"}}"
    kwargs = dict(tools=[Tool.read_file], backend=sim_url, model="sim-model")
    if engine == "embedded":
        monkeypatch.setenv("AGENTBATCH_FILE_ROOT", str(root))
        monkeypatch.delenv("AGENTBATCH_REDIS_URL", raising=False)
        [result] = run_batch(task, [{}], **kwargs)
    else:
        start_workers(1, env={"AGENTBATCH_FILE_ROOT": str(root)})
        [result] = submit_batch(task, [{}], redis_url=redis_url, **kwargs).wait(timeout=120)
    [call] = result.tool_calls
    assert not call.ok
    assert call.error is not None and "outside the allowed root" in call.error, call
    assert "../secret.txt" in call.error


FAKE_BUILD = """
import sys
print("-- Configuring done")
for pct in (0, 3, 3, 48, 97, 100):
    print(f"[{pct:3d}%] Building CXX object obj{pct}.o", flush=True)
print("[100%] Built target llama-server")
print("warning: a compiler note", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def _fake_build(tmp_path: Path, every_s: float, code: int = 0) -> tuple[list[str], Path]:
    from agentbatch.engine.install import _run_logged

    script = tmp_path / "fake_build.py"
    script.write_text(FAKE_BUILD)
    log_path = tmp_path / "build.log"
    said: list[str] = []
    _run_logged([sys.executable, str(script), str(code)], log_path, progress=said.append,
                every_s=every_s)
    return said, log_path


def test_engine_build_relays_cmake_progress_and_logs_everything(tmp_path: Path) -> None:
    said, log_path = _fake_build(tmp_path, every_s=0.0)
    assert said == [f"[{p:3d}%] Building CXX object obj{p}.o" for p in (0, 3, 3, 48, 97, 100)
                    ] + ["[100%] Built target llama-server"]
    logged = log_path.read_text()
    assert "-- Configuring done" in logged and "a compiler note" in logged
    assert "Built target llama-server" in logged


def test_engine_build_progress_is_throttled_but_ends_with_the_last_line(
        tmp_path: Path) -> None:
    said, _ = _fake_build(tmp_path, every_s=3600.0)
    assert said == ["[  0%] Building CXX object obj0.o", "[100%] Built target llama-server"]


def test_engine_build_failure_names_the_log_tail(tmp_path: Path) -> None:
    from agentbatch.engine import EngineError

    with pytest.raises(EngineError, match=r"failed \(exit 3\)[\s\S]*a compiler note"):
        _fake_build(tmp_path, every_s=0.0, code=3)


def test_engine_build_over_its_deadline_is_stopped_with_its_children(tmp_path: Path) -> None:
    """A build step past its deadline is killed with the processes it started (make and the
    compilers hold the output pipe too), and the error says it took too long."""
    from agentbatch.engine import EngineError
    from agentbatch.engine.install import _run_logged

    script = tmp_path / "hang.py"
    script.write_text("import subprocess, sys, time\n"
                      "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
                      "print('[  1%] Building', flush=True)\ntime.sleep(600)\n")
    said: list[str] = []
    with pytest.raises(EngineError, match="took over 2s"):
        _run_logged([sys.executable, str(script)], tmp_path / "build.log",
                    progress=said.append, every_s=0.0, timeout_s=2.0)
    assert said == ["[  1%] Building"]


def test_run_batch_logs_which_engine_ran(redis_url: str, sim_url: str, start_workers,
                                         monkeypatch: pytest.MonkeyPatch,
                                         caplog: pytest.LogCaptureFixture) -> None:
    """With AGENTBATCH_REDIS_URL exported (for the workers), a plain run_batch goes through
    Redis: the submit log line says so."""
    caplog.set_level(logging.INFO, logger="agentbatch")
    monkeypatch.delenv("AGENTBATCH_REDIS_URL", raising=False)
    run_batch("Hi {x}.", [{"x": 1}], backend=sim_url, model="sim-model")
    embedded = [r.getMessage() for r in caplog.records if "engine" in r.getMessage()]
    assert len(embedded) == 1 and "on the embedded (in this process) engine" in embedded[0]
    caplog.clear()
    start_workers(1)
    monkeypatch.setenv("AGENTBATCH_REDIS_URL", redis_url)
    run_batch("Hi {x}.", [{"x": 1}], backend=sim_url, model="sim-model")
    lines = [r.getMessage() for r in caplog.records if "engine" in r.getMessage()]
    assert lines == [lines[0]] and f"on the distributed (Redis {redis_url}) engine" in lines[0]


def test_agentbatch_run_prints_which_engine_ran(tmp_path: Path, redis_url: str, sim_url: str,
                                                start_workers) -> None:
    (tmp_path / "spec.yaml").write_text(
        f'task: "Hi {{x}}"\ninputs: [{{"x": 1}}]\nmodel: m\nbackend: "{sim_url}"\n')
    proc = _cli("run", str(tmp_path / "spec.yaml"), "-o", str(tmp_path / "a.jsonl"))
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "agent(s) on the embedded (in this process) engine" in proc.stdout, proc.stdout
    start_workers(1)
    proc = _cli("run", str(tmp_path / "spec.yaml"), "-o", str(tmp_path / "b.jsonl"),
                env={"AGENTBATCH_REDIS_URL": redis_url})
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert f"on the distributed (Redis {redis_url}) engine" in proc.stdout, proc.stdout


@pytest.fixture(scope="module")
def locked_redis():
    """A throwaway redis-server that wants a password the URLs below do not give."""
    server = RedisServer(password="right-pass-5c1e").start()
    yield server
    server.cleanup()


WRONG = "wrong-pass-9d2a"


def _wrong_url(server: RedisServer) -> tuple[str, str]:
    """(a URL with the wrong password, how an error may show it)."""
    return (f"redis://:{WRONG}@127.0.0.1:{server.port}/0",
            f"redis://:***@127.0.0.1:{server.port}/0")


def _says_auth_refused(text: str, shown: str) -> None:
    assert f"Redis at {shown} refused the credentials" in text, text
    assert WRONG not in text and "right-pass" not in text, text


def test_wrong_password_at_submit(locked_redis: RedisServer, sim_url: str) -> None:
    from agentbatch.core.errors import ConfigError

    url, shown = _wrong_url(locked_redis)
    with pytest.raises(ConfigError) as caught:
        submit_batch("Hi {x}.", [{"x": 1}], backend=sim_url, model="m", redis_url=url)
    _says_auth_refused(str(caught.value), shown)


def test_wrong_password_at_status(locked_redis: RedisServer) -> None:
    url, shown = _wrong_url(locked_redis)
    proc = _cli("status", "0123456789abcdef", "--redis-url", url, env={"COLUMNS": "200"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    _says_auth_refused(proc.stderr, shown)


def test_wrong_password_at_worker_start(locked_redis: RedisServer) -> None:
    """Before: Celery retried 'Cannot connect ... invalid username-password pair' for ever."""
    url, shown = _wrong_url(locked_redis)
    proc = _cli("worker", "--redis-url", url, env={
        "COLUMNS": "200", "AGENTBATCH_WORKER_IMPORTS": "tests.support"}, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    _says_auth_refused(proc.stderr, shown)
    assert redis.from_url(locked_redis.url).ping()  # the right password still works
