"""One pooled, loop-bound httpx client per HTTP backend, and JSON/SSE POSTs mapped to our errors.

Used by the Anthropic driver, and by the OpenAI-compatible one only when an httpx transport
is injected (tests, custom routing; its default is ``AiohttpSession``); both sessions map
failures through ``http_errors``, so every driver classifies them identically.
The client is created lazily inside the running event loop (and re-created if the backend is
later used from a different loop), because an httpx client is bound to the loop it first ran
on. Thousands of concurrent turns ride one pool of HTTP/1.1 keep-alive connections instead of
opening a socket per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import httpx

from agentbatch.backends import limits
from agentbatch.backends.http_errors import error_for_exception, error_for_status
from agentbatch.core.errors import BackendTimeout, BadRequest
from agentbatch.core.wait_for import wait_for

CONNECT_TIMEOUT_S = 10.0
# Below uvicorn's 5 s keep-alive default, so we rarely reuse a socket the server just closed.
KEEPALIVE_EXPIRY_S = 4.0


# ``json.dumps(body, ensure_ascii=False, allow_nan=False)``'s encoder, made once: ``dumps``
# builds a new one on each call that passes any argument, so on every turn (issue 26 item 5).
_BODY = json.JSONEncoder(ensure_ascii=False, allow_nan=False)


def encode_json(body: dict[str, Any], who: str) -> bytes:
    """Request bytes; a body that cannot be JSON is the caller's bug, so ``BadRequest``."""
    try:
        return _BODY.encode(body).encode()
    except (TypeError, ValueError) as exc:
        raise BadRequest(f"{who}: request is not JSON-serializable: {exc}") from None


class HttpSession:
    """A lazily created ``httpx.AsyncClient`` plus error mapping; ``secret`` is scrubbed."""

    def __init__(
        self,
        base_url: str,
        *,
        who: str,
        headers: dict[str, str],
        timeout: float,
        max_connections: int,
        secret: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        max_response_bytes: int | None = None,
    ) -> None:
        self.base_url = base_url
        self.who = who
        self.headers = headers
        self.timeout = timeout
        self.max_connections = max_connections
        self.secret = secret
        self._transport = transport
        self.max_response_bytes = max_response_bytes or limits.max_response_bytes()
        self._http: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.requests_sent = 0

    def client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        if self._http is None or self._loop is not loop:
            self._http = httpx.AsyncClient(
                headers=self.headers,
                limits=httpx.Limits(
                    max_connections=self.max_connections,
                    max_keepalive_connections=self.max_connections,
                    keepalive_expiry=KEEPALIVE_EXPIRY_S,
                ),
                timeout=httpx.Timeout(self.timeout, connect=min(self.timeout, CONNECT_TIMEOUT_S)),
                transport=self._transport,
                follow_redirects=False,  # a 3xx must not carry the prompt to another origin
            )
            self._loop = loop
        return self._http

    def _per_op(self, timeout: float) -> httpx.Timeout:
        return httpx.Timeout(timeout, connect=min(timeout, CONNECT_TIMEOUT_S))

    async def _check(self, resp: httpx.Response) -> None:
        """Raise the mapped error for a non-2xx streamed response (its body read capped)."""
        if not 200 <= resp.status_code < 300:
            body = await self._read(resp, limits.MAX_ERROR_BODY_BYTES, truncate=True)
            raise error_for_status(
                resp.status_code, resp.headers, body, who=self.who, secret=self.secret
            )

    async def _read(self, resp: httpx.Response, limit: int, truncate: bool = False) -> bytes:
        """A streamed body, at most ``limit`` (decoded) bytes (``limits.read_capped``)."""
        declared = resp.headers.get("content-length", "")
        return await limits.read_capped(resp.aiter_bytes(), limit, who=self.who,
                                        declared=int(declared) if declared.isdigit() else None,
                                        truncate=truncate)

    async def post_json(
        self, path: str, body: dict[str, Any], headers: dict[str, str], timeout: float,
        *, model_request: bool = True,
    ) -> Any:
        """POST ``body``; the decoded JSON reply, or the mapped ``BackendError``.

        ``timeout`` bounds the whole exchange, not just each socket read. ``requests_sent``
        counts model requests only (not ``/tokenize`` and the like).
        """
        payload = encode_json(body, self.who)
        headers = {"Content-Type": "application/json", **headers}
        client = self.client()
        self.requests_sent += model_request
        request = client.build_request(
            "POST", self.base_url + path, content=payload, headers=headers,
            timeout=self._per_op(timeout),
        )

        async def exchange() -> tuple[int, bytes]:
            resp = await client.send(request, stream=True)
            try:
                await self._check(resp)
                return resp.status_code, await self._read(resp, self.max_response_bytes)
            finally:
                await resp.aclose()

        try:
            status, raw = await wait_for(exchange(), timeout)
        except asyncio.TimeoutError:
            raise BackendTimeout(f"{self.who}: no answer within {timeout:g}s") from None
        except httpx.HTTPError as exc:
            raise error_for_exception(exc, who=self.who, secret=self.secret) from None
        return limits.decode_json(raw, who=self.who, status=status, secret=self.secret)

    @contextlib.asynccontextmanager
    async def post_lines(
        self, path: str, body: dict[str, Any], headers: dict[str, str], timeout: float
    ) -> AsyncIterator[AsyncIterator[str]]:
        """POST ``body`` and yield the response's text lines as they arrive (for SSE).

        Transport failures, including those while reading the stream, become ``BackendError``s;
        the caller bounds the total time (it owns the loop that reads the lines).
        """
        payload = encode_json(body, self.who)
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream", **headers}
        client = self.client()
        self.requests_sent += 1
        request = client.build_request(
            "POST",
            self.base_url + path,
            content=payload,
            headers=headers,
            timeout=self._per_op(timeout),
        )
        try:
            resp = await client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise error_for_exception(exc, who=self.who, secret=self.secret) from None
        lines = self._lines(resp)
        try:
            await self._check(resp)
            yield lines
        finally:
            await lines.aclose()  # the reader may stop at [DONE], before the body ends
            await resp.aclose()

    async def _lines(self, resp: httpx.Response) -> AsyncGenerator[str, None]:
        splitter = limits.LineSplitter(who=self.who, max_total=self.max_response_bytes)
        try:
            async for chunk in resp.aiter_bytes():
                for line in splitter.feed(chunk):
                    yield line
            for line in splitter.flush():
                yield line
        except httpx.HTTPError as exc:
            raise error_for_exception(exc, who=self.who, secret=self.secret) from None

    async def get_status(self, path: str, timeout: float) -> int | None:
        """The status of ``GET path``; None when the server does not answer at all."""
        try:
            resp = await wait_for(
                self.client().get(self.base_url + path, timeout=self._per_op(timeout)), timeout
            )
        except (asyncio.TimeoutError, httpx.HTTPError):
            return None
        return resp.status_code

    async def get_text(self, path: str, timeout: float) -> str | None:
        """The body of ``GET path`` when it answers 200; None otherwise (never raises)."""
        try:
            resp = await wait_for(
                self.client().get(self.base_url + path, timeout=self._per_op(timeout)), timeout
            )
        except (asyncio.TimeoutError, httpx.HTTPError):
            return None
        return resp.text if resp.status_code == 200 else None

    async def aclose(self) -> None:
        """Close the pooled connections. Safe to call twice, or before first use."""
        client, self._http, self._loop = self._http, None, None
        if client is not None:
            # RuntimeError: created on a loop that is gone, and its sockets went with it.
            with contextlib.suppress(RuntimeError):
                await client.aclose()
