"""The same session interface as ``HttpSession``, over aiohttp, for high-concurrency backends.

With hundreds of requests in flight httpx's connection pool costs far more CPU per request
than aiohttp (the numbers: docs/design-notes.md, from benchmarks/results/http_clients.json).
An inference backend serves hundreds of concurrent agent turns, so the OpenAI-compatible
driver uses this session by default; httpx stays where concurrency is low.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp

from agentbatch.backends import limits
from agentbatch.backends.http_errors import error_for_status, redact
from agentbatch.backends.http_session import CONNECT_TIMEOUT_S, KEEPALIVE_EXPIRY_S, encode_json
from agentbatch.core.errors import BackendTimeout, BackendUnavailable


class AiohttpSession:
    """A lazily created ``aiohttp.ClientSession`` bound to the running loop, plus error mapping."""

    def __init__(self, base_url: str, *, who: str, headers: dict[str, str], timeout: float,
                 max_connections: int, secret: str | None = None,
                 max_response_bytes: int | None = None) -> None:
        self.base_url = base_url
        self.who = who
        self.headers = headers
        self.timeout = timeout
        self.max_connections = max_connections
        self.secret = secret
        self.max_response_bytes = max_response_bytes or limits.max_response_bytes()
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.requests_sent = 0
        self._last_timeout: aiohttp.ClientTimeout | None = None

    def session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._loop is not loop or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0,
                                             keepalive_timeout=KEEPALIVE_EXPIRY_S,
                                             enable_cleanup_closed=True)
            self._session = aiohttp.ClientSession(headers=self.headers, connector=connector,
                                                  trust_env=False)
            self._loop = loop
        return self._session

    def _timeout(self, timeout: float) -> aiohttp.ClientTimeout:
        """The (immutable) ``ClientTimeout``; the last one is kept: a batch's turns all
        send the same ``timeout_s``, so it is not made again on every turn."""
        last = self._last_timeout
        if last is None or last.total != timeout:
            last = self._last_timeout = aiohttp.ClientTimeout(
                total=timeout, connect=min(timeout, CONNECT_TIMEOUT_S))
        return last

    def _unavailable(self, exc: BaseException) -> BackendUnavailable:
        detail = redact(f"{type(exc).__name__}: {exc}", self.secret)
        return BackendUnavailable(f"{self.who}: cannot reach {self.base_url}: {detail}")

    @contextlib.contextmanager
    def _mapped(self, timeout: float, waiting_for: str = "no answer") -> Iterator[None]:
        """aiohttp's transport failures as our ``BackendError`` tree."""
        try:
            yield
        except asyncio.TimeoutError:
            raise BackendTimeout(f"{self.who}: {waiting_for} within {timeout:g}s") from None
        except aiohttp.ClientError as exc:
            raise self._unavailable(exc) from None

    async def _raise_for_status(self, resp: aiohttp.ClientResponse) -> None:
        if not 200 <= resp.status < 300:
            body = await self._read(resp, limits.MAX_ERROR_BODY_BYTES, truncate=True)
            raise error_for_status(resp.status, resp.headers, body, who=self.who,
                                   secret=self.secret)

    async def _read(self, resp: aiohttp.ClientResponse, limit: int,
                    truncate: bool = False) -> bytes:
        """The body, at most ``limit`` bytes (``limits.read_capped``). A body of a declared
        length within the limit, not compressed, is read at once: the HTTP parser delivers
        exactly that many bytes (issue 26 item 5: no async generator on every turn)."""
        declared = resp.content_length
        if (declared is not None and declared <= limit and not truncate
                and resp.headers.get("Content-Encoding", "identity") == "identity"):
            return await resp.read()
        return await limits.read_capped(resp.content.iter_any(), limit, who=self.who,
                                        declared=resp.content_length, truncate=truncate)

    async def post_json(self, path: str, body: dict[str, Any], headers: dict[str, str],
                        timeout: float, *, model_request: bool = True) -> Any:
        """POST ``body``; the decoded JSON reply, or the mapped ``BackendError``.
        ``requests_sent`` counts model requests only (not ``/tokenize`` and the like)."""
        payload = encode_json(body, self.who)
        headers = {"Content-Type": "application/json", **headers}
        self.requests_sent += model_request
        with self._mapped(timeout):
            async with self.session().post(self.base_url + path, data=payload, headers=headers,
                                           timeout=self._timeout(timeout),
                                           allow_redirects=False) as resp:
                await self._raise_for_status(resp)
                raw = await self._read(resp, self.max_response_bytes)
                status = resp.status
        return limits.decode_json(raw, who=self.who, status=status, secret=self.secret)

    @contextlib.asynccontextmanager
    async def post_lines(self, path: str, body: dict[str, Any], headers: dict[str, str],
                         timeout: float) -> AsyncIterator[AsyncIterator[str]]:
        """POST ``body`` and yield the response's text lines as they arrive (for SSE)."""
        payload = encode_json(body, self.who)
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream", **headers}
        self.requests_sent += 1
        with self._mapped(timeout):
            resp = await self.session().post(self.base_url + path, data=payload,
                                             headers=headers, timeout=self._timeout(timeout),
                                             allow_redirects=False)
        try:
            await self._raise_for_status(resp)
            yield self._lines(resp, timeout)
        finally:
            resp.release()

    async def _lines(self, resp: aiohttp.ClientResponse, timeout: float) -> AsyncIterator[str]:
        splitter = limits.LineSplitter(who=self.who, max_total=self.max_response_bytes)
        with self._mapped(timeout, "stream stalled"):
            async for chunk in resp.content.iter_any():
                for line in splitter.feed(chunk):
                    yield line
            for line in splitter.flush():
                yield line

    async def _get(self, path: str, timeout: float) -> tuple[int, str] | None:
        try:
            async with self.session().get(self.base_url + path,
                                          timeout=self._timeout(timeout)) as resp:
                return resp.status, await resp.text()
        except (asyncio.TimeoutError, aiohttp.ClientError):
            return None

    async def get_status(self, path: str, timeout: float) -> int | None:
        """The status of ``GET path``; None when the server does not answer at all."""
        got = await self._get(path, timeout)
        return got[0] if got else None

    async def get_text(self, path: str, timeout: float) -> str | None:
        """The body of ``GET path`` when it answers 200; None otherwise (never raises)."""
        got = await self._get(path, timeout)
        return got[1] if got and got[0] == 200 else None

    async def aclose(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None
