"""Run the installed ``llama-server`` on a free 127.0.0.1 port, for tests, the demo and benchmarks.

``LlamaServer`` starts the process with what agentbatch reads from it (``--metrics`` for queue
and prefix-cache gauges, ``--slots``), several parallel slots so a batch has something to
overlap, and the model under a short alias. ``start()`` waits for ``/health`` with a deadline;
a port in use, a crash or a server that never becomes healthy is an ``EngineError`` carrying
the tail of the server's log. ``stop()`` (or leaving the ``with`` block) ends the process.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import logging
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

from agentbatch.engine.install import INSTALL_COMMAND, EngineError, EnginePaths, installed, log_tail

log = logging.getLogger(__name__)

MODEL_ALIAS = "smollm2"  # the name /v1/models reports and requests may use
DEFAULT_PARALLEL = 4
DEFAULT_CTX_PER_SLOT = 2048
START_TIMEOUT_S = 120.0


def default_threads() -> int:
    """Half the CPUs (1 on this 2-core machine), leaving the rest to the client.

    llama.cpp's compute threads spin at each barrier; when they outnumber the free cores they
    wait on one another. Measured here (2 cores shared with other work), 16 structured-output
    agents took 10-12 s with ``-t 1`` and 61-73 s with ``-t 2``; one request generated 45-48
    tokens/s with ``-t 1`` and 6-21 tokens/s with ``-t 2``.
    """
    return max(1, (os.cpu_count() or 2) // 2)

# ``--slot-prompt-similarity 0``: llama.cpp then takes the least recently used slot for each
# request, and that path always saves the slot's conversation to its host-memory prompt cache
# (``--cache-ram``, 8 GiB by default) and restores the best match for the new request. With the
# default (0.1) it picks the slot sharing the longest prefix, and saves the old conversation
# only when more than half of it would be lost (``server-context.cpp``), which a long shared
# system prompt never allows, so an agent's second turn recomputed its first turn's messages.
# tests/engine/test_llamacpp_engine.py checks the difference: 405 of 423 prompt tokens cached
# on a second turn after 8 other requests, against 371 (the system prompt) with the default.
SLOT_SELECTION = ("--slot-prompt-similarity", "0")


def cache_defeating_flags(args: tuple[str, ...] | list[str]) -> list[str]:
    """The flags in a ``llama-server`` command line that make a repeated prefix be computed
    again (this build's ``server-context.cpp``): ``--cache-ram 0`` removes the host-memory
    prompt cache, which least-recently-used slot selection (``--slot-prompt-similarity 0``)
    relies on to find a prefix another slot computed (with similarity selection the repeat
    goes to the slot holding it); ``--no-cache-prompt`` turns caching off for requests that
    do not ask for it (agentbatch's do)."""
    args = list(args)
    found: list[str] = []

    def value(*names: str) -> str | None:
        hit = None
        for i, arg in enumerate(args):
            for name in names:
                if arg == name and i + 1 < len(args):
                    hit = args[i + 1]
                elif arg.startswith(name + "="):
                    hit = arg.split("=", 1)[1]
        return hit

    cache_ram = value("--cache-ram", "-cram")
    similarity = value("--slot-prompt-similarity", "-sps")
    lru = similarity is not None and float(similarity) == 0.0
    if lru and cache_ram is not None and cache_ram.strip() == "0":
        found.append("--cache-ram 0 with --slot-prompt-similarity 0")
    if "--no-cache-prompt" in args:
        found.append("--no-cache-prompt (for requests without cache_prompt)")
    return found

STOP_TIMEOUT_S = 15.0
FREE_PORT_TRIES = 3  # a free port can be taken between our probe and the server's bind
_BIND_FAILED = ("couldn't bind", "address already in use", "failed to bind")


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free now (the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_in_use(host: str, port: int) -> bool:
    """True when ``host:port`` cannot be bound (someone listens there)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: SIGTERM the server when the process that started it dies (no orphans)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _exit_reason(code: int) -> str:
    """How the process ended: a signal by name (a crash says SIGSEGV, not -11)."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"it was killed by {signal.Signals(-code).name} (exit code {code})"
    return f"it exited with code {code}"


class LlamaServer:
    """One ``llama-server`` process serving the installed model."""

    def __init__(
        self,
        paths: EnginePaths | None = None,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        parallel: int = DEFAULT_PARALLEL,
        ctx_per_slot: int = DEFAULT_CTX_PER_SLOT,
        threads: int | None = None,  # default: ``default_threads()``
        alias: str = MODEL_ALIAS,
        extra_args: tuple[str, ...] = (),
        die_with_parent: bool = True,
        slot_selection: bool = True,
        cpus: tuple[int, ...] | None = None,
    ) -> None:
        paths = paths or installed()
        if paths is None:
            raise EngineError(f"llama-server is not installed; run `{INSTALL_COMMAND}`")
        if parallel < 1:
            raise ValueError(f"parallel must be >= 1, got {parallel}")
        if ctx_per_slot < 256:
            raise ValueError(f"ctx_per_slot must be >= 256, got {ctx_per_slot}")
        self.paths = paths
        self.host = host
        self.requested_port = port
        self.port = port or 0
        self.parallel = parallel
        self.ctx_per_slot = ctx_per_slot
        self.threads = threads or default_threads()
        self.model = alias
        self.extra_args = extra_args
        self.die_with_parent = die_with_parent
        # False: llama.cpp's own slot selection (by prompt similarity), as a user starts it
        self.slot_selection = slot_selection
        self.cpus = cpus  # pin the server to these CPUs (sched_setaffinity), e.g. (0,)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path: Path | None = None
        self.start_seconds: float | None = None  # spawn to healthy, measured by start()

    # URLs ---------------------------------------------------------------------------------
    @property
    def http_url(self) -> str:
        """``http://host:port``: the plain HTTP address (``/health``, ``/metrics``, ``/v1``)."""
        return f"http://{self.host}:{self.port}"

    url = http_url

    @property
    def llamacpp_url(self) -> str:
        """``llamacpp://host:port``: the agentbatch backend URL for this server."""
        return f"llamacpp://{self.host}:{self.port}"

    @property
    def backend(self) -> str:
        """The backend URL agentbatch should use: ``llamacpp://`` where that scheme exists."""
        from agentbatch.backends.urls import KNOWN_SCHEMES

        return self.llamacpp_url if "llamacpp" in KNOWN_SCHEMES else self.http_url

    def command(self) -> list[str]:
        """The ``llama-server`` command line for the current port."""
        cmd = [
            str(self.paths.server), "-m", str(self.paths.model), "--alias", self.model,
            "--host", self.host, "--port", str(self.port),
            "-c", str(self.ctx_per_slot * self.parallel), "-np", str(self.parallel),
            "--metrics", "--slots", "--jinja", "-t", str(self.threads),
        ]
        if self.slot_selection:
            # Pick slots least-recently-used, not by prompt similarity: see SLOT_SELECTION.
            cmd.extend(SLOT_SELECTION)
        return [*cmd, *self.extra_args]

    def _preexec(self) -> None:  # pragma: no cover - runs in the child before exec
        if self.die_with_parent:
            _die_with_parent()
        if self.cpus:
            os.sched_setaffinity(0, set(self.cpus))

    # lifecycle ----------------------------------------------------------------------------
    def start(self, timeout: float = START_TIMEOUT_S) -> LlamaServer:
        """Spawn the server and wait until ``/health`` says ok, or raise ``EngineError``."""
        if self.proc is not None:
            raise RuntimeError("this LlamaServer is already started")
        if self.requested_port is not None:
            if port_in_use(self.host, self.requested_port):
                raise EngineError(
                    f"port {self.requested_port} on {self.host} is in use; pick another port "
                    "or leave it out to get a free one")
            self._spawn_and_wait(timeout)
            return self
        for attempt in range(FREE_PORT_TRIES):
            self.port = free_port(self.host)
            try:
                self._spawn_and_wait(timeout)
                return self
            except _PortTaken:
                if attempt == FREE_PORT_TRIES - 1:
                    raise EngineError(f"{FREE_PORT_TRIES} free ports were taken before "
                                      "llama-server could bind them") from None
        raise AssertionError("unreachable")

    def _spawn_and_wait(self, timeout: float) -> None:
        defeating = cache_defeating_flags(self.command())
        if defeating:
            log.warning("llama-server started with %s: a repeated prefix is computed again "
                        "(docs/engine-llamacpp.md)", ", ".join(defeating))
        fd, log_name = tempfile.mkstemp(prefix=f"llama-server-{self.port}-", suffix=".log")
        self.log_path = Path(log_name)
        started = time.monotonic()
        with os.fdopen(fd, "wb") as log_fh:
            self.proc = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=log_fh,
                stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=self._preexec if self.die_with_parent or self.cpus else None)
        deadline = started + timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                tail = log_tail(self.log_path)
                self._forget()
                if self.requested_port is None and any(
                        s in tail.lower() for s in _BIND_FAILED):
                    raise _PortTaken
                hint = (f"port {self.port} on {self.host} is in use; pick another port"
                        if any(s in tail.lower() for s in _BIND_FAILED) else
                        _exit_reason(code))
                raise EngineError(f"llama-server did not start: {hint}. Last lines of its "
                                  f"log:\n{tail}")
            if self._healthy():
                self.start_seconds = time.monotonic() - started
                return
            if time.monotonic() > deadline:
                tail = log_tail(self.log_path)
                self.stop()
                raise EngineError(f"llama-server was not healthy at {self.http_url}/health "
                                  f"within {timeout:.0f}s. Last lines of its log:\n{tail}")
            time.sleep(0.1)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.http_url}/health", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False  # 503 while the model loads, or not listening yet

    def _forget(self) -> None:
        """Drop a process that exited on its own, and its log (its tail is in the error)."""
        self.proc = None
        if self.log_path is not None:
            with contextlib.suppress(OSError):
                self.log_path.unlink()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """End the server (SIGTERM, then SIGKILL after ``timeout``); safe to call twice."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
        if self.log_path is not None:
            with contextlib.suppress(OSError):
                self.log_path.unlink()

    def log(self) -> str:
        """The server's log so far (tail), for error messages and debugging."""
        return log_tail(self.log_path) if self.log_path else ""

    def get_json(self, path: str, timeout: float = 30.0) -> Any:
        """GET ``path`` on the server and decode its JSON body."""
        with urllib.request.urlopen(f"{self.http_url}{path}", timeout=timeout) as resp:
            return json.loads(resp.read())

    def __enter__(self) -> LlamaServer:
        return self.start() if self.proc is None else self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LlamaServer({self.http_url}, model={self.model!r}, parallel={self.parallel})"


class _PortTaken(Exception):
    """The free port we picked was bound by someone else first; try another."""
