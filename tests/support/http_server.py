"""One small HTTP server for tests: an aiohttp application on 127.0.0.1:<free port>, served
from its own thread and event loop.

Its own loop is what lets synchronous tests, the embedded engine's thread and worker
subprocesses all reach it. A fake server subclasses ``ThreadedServer`` and declares its
routes in ``add_routes`` (or passes a ``routes`` function); ``start``/``stop`` or ``with``
run it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TypeVar

from aiohttp import web

Routes = Callable[[web.Application], None]
S = TypeVar("S", bound="ThreadedServer")


class ThreadedServer:
    """An aiohttp app served from a daemon thread; ``port`` is known once ``start`` returns."""

    def __init__(self, routes: Routes | None = None, *, name: str = "test-http",
                 shutdown_timeout: float = 60.0) -> None:
        self._routes = routes
        self._name = name
        self._shutdown_timeout = shutdown_timeout
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add_routes(self, app: web.Application) -> None:
        """Declare the routes; a subclass overrides this, or passes ``routes``."""
        if self._routes is None:
            raise NotImplementedError("pass routes= or override add_routes")
        self._routes(app)

    def start(self: S, timeout: float = 30) -> S:
        """Serve, and return ``self`` once the port is bound (an error there is raised here)."""
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._loop = loop
            try:
                app = web.Application()
                self.add_routes(app)
                runner = web.AppRunner(app, shutdown_timeout=self._shutdown_timeout)
                loop.run_until_complete(runner.setup())
                loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
                self.port = runner.addresses[0][1]
            except BaseException as exc:  # surfaced by start() below
                errors.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=run, daemon=True, name=self._name)
        self._thread.start()
        if not ready.wait(timeout):
            raise TimeoutError(f"{self._name} did not start within {timeout} s")
        if errors:
            raise errors[0]
        return self

    def stop(self, timeout: float = 30) -> None:
        """Stop serving; waits at most ``timeout`` for the thread (it is a daemon)."""
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)

    def __enter__(self: S) -> S:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
