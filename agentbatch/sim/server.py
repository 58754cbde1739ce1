"""The aiohttp application, an in-process server on a background thread, and ``run_sim``."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import replace
from typing import Any

from aiohttp import web

from agentbatch.sim import batch_api, handlers
from agentbatch.sim.config import SimConfig
from agentbatch.sim.handlers import STATE
from agentbatch.sim.state import SimState

# Bursts of 1,000+ new connections must not overflow the listen queue (SYN retries cost 1 s).
BACKLOG = 4096
SHUTDOWN_TIMEOUT_S = 0.5


def build_app(config: SimConfig | None = None) -> web.Application:
    """The simulator as an aiohttp app; the engine loop starts and stops with the app."""
    state = SimState(config or SimConfig())
    app = web.Application(client_max_size=64 * 1024**2)
    app[STATE] = state
    app.router.add_post("/v1/chat/completions", handlers.chat_completions)
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_get("/v1/models", handlers.models)
    app.router.add_post("/tokenize", handlers.tokenize)
    app.router.add_post("/detokenize", handlers.detokenize)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/metrics", handlers.metrics)
    app.router.add_get("/sim/stats", handlers.sim_stats)
    app.router.add_post("/sim/reset", handlers.sim_reset)
    app.router.add_get("/sim/batch_jobs", handlers.sim_batch_jobs)
    batch_api.install(app, state.config)  # OpenAI files + batches, Anthropic batches

    async def start_engine(app: web.Application) -> None:
        await app[STATE].engine.start()

    async def stop_engine(app: web.Application) -> None:
        await app[STATE].engine.stop()

    app.on_startup.append(start_engine)
    app.on_cleanup.append(stop_engine)
    return app


def make_runner(app: web.Application, handle_signals: bool = False) -> web.AppRunner:
    """Runner settings that matter for a load generator: no access log, abort on disconnect."""
    return web.AppRunner(
        app,
        handle_signals=handle_signals,
        access_log=None,
        handler_cancellation=True,
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )


async def serve(config: SimConfig, handle_signals: bool = False) -> tuple[web.AppRunner, int]:
    """Start serving ``config`` on the running loop; returns the runner and the bound port."""
    runner = make_runner(build_app(config), handle_signals)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, backlog=BACKLOG)
    await site.start()
    return runner, site.port


def run_sim(config: SimConfig) -> None:
    """Serve forever (until SIGINT/SIGTERM); prints the URL once listening."""

    async def main() -> None:
        runner, port = await serve(config, handle_signals=True)
        print(f"agentbatch sim listening on http://{config.host}:{port}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    with contextlib.suppress(KeyboardInterrupt, web.GracefulExit):
        asyncio.run(main())


class SimServer:
    """The simulator on ``127.0.0.1`` in a background thread with its own event loop.

    ``with SimServer(fixed_ms=5) as sim: httpx.get(sim.url + "/health")``. Keyword arguments
    override fields of ``config``.
    """

    def __init__(self, config: SimConfig | None = None, /, **overrides: Any) -> None:
        self.config = replace(config or SimConfig(), **overrides)
        self.port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("SimServer is not started")
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "") else self.config.host
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI-client base URL (``.../v1``)."""
        return self.url + "/v1"

    @property
    def state(self) -> SimState:
        """Live state for white-box tests; only read it (it belongs to the server's loop)."""
        if self._runner is None:
            raise RuntimeError("SimServer is not started")
        return self._runner.app[STATE]

    def start(self, timeout: float = 30.0) -> SimServer:
        if self._thread is not None:
            return self
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name="agentbatch-sim", daemon=True
        )
        self._thread.start()
        if not ready.wait(timeout):
            raise RuntimeError("agentbatch sim did not start in time")
        if self._error is not None:
            self._thread.join()
            self._thread = None
            raise RuntimeError(f"agentbatch sim failed to start: {self._error!r}") from self._error
        return self

    def _run(self, ready: threading.Event) -> None:
        loop = self._loop
        assert loop is not None
        asyncio.set_event_loop(loop)
        try:
            self._runner, self.port = loop.run_until_complete(serve(self.config))
        except BaseException as exc:
            self._error = exc
            ready.set()
            loop.close()
            return
        ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self._runner.cleanup())
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is None or self._loop is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        self._thread = None
        self._runner = None
        self.port = None

    def __enter__(self) -> SimServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
