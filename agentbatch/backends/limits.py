"""Caps on what a model server may send back, so one runaway reply cannot exhaust a worker.

A body (or a stream) larger than ``AGENTBATCH_MAX_RESPONSE_BYTES`` (32 MB by default), an
SSE line over 512 KB, or JSON nested deeper than the decoder can follow ends the turn with a
``server_error``, without reading the rest. It is not retried (``ResponseTooLarge``): the same
request to the same server is expected to produce the same runaway reply, and each retry
would read up to the cap again. A deployment that legitimately needs larger replies raises
the cap.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterable
from typing import Any

from agentbatch.backends.http_errors import redact
from agentbatch.core.errors import ConfigError, ServerError

MAX_RESPONSE_BYTES_ENV = "AGENTBATCH_MAX_RESPONSE_BYTES"
DEFAULT_MAX_RESPONSE_BYTES = 32 * 1024 * 1024
MAX_LINE_BYTES = 512 * 1024
# An error body is only shown truncated; never read more of it than this.
MAX_ERROR_BODY_BYTES = 64 * 1024


class ResponseTooLarge(ServerError):
    """The server's reply broke a size or shape cap; kind ``server_error``, not retried."""

    retryable = False


def max_response_bytes() -> int:
    """The byte cap for one response, from ``AGENTBATCH_MAX_RESPONSE_BYTES`` when set."""
    raw = os.environ.get(MAX_RESPONSE_BYTES_ENV, "").strip()
    if not raw:
        return DEFAULT_MAX_RESPONSE_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"{MAX_RESPONSE_BYTES_ENV} must be a positive integer, got {raw!r}")
    return value


def too_large(who: str, limit: int, what: str = "response body") -> ResponseTooLarge:
    return ResponseTooLarge(
        f"{who}: {what} exceeds {limit} bytes; stopped reading "
        f"(raise {MAX_RESPONSE_BYTES_ENV} if such replies are expected)",
        status=200,
    )


async def read_capped(chunks: AsyncIterable[bytes], limit: int, *, who: str,
                      declared: int | None = None, truncate: bool = False) -> bytes:
    """A response body of at most ``limit`` bytes, for either HTTP client: cut there
    (``truncate``) or ``ResponseTooLarge`` without reading on; a ``declared`` oversize length
    fails before reading at all."""
    if not truncate and (declared or 0) > limit:
        raise too_large(who, limit)
    body = bytearray()
    async for chunk in chunks:
        body += chunk
        if len(body) > limit:
            if truncate:
                return bytes(body[:limit])
            raise too_large(who, limit)
    return bytes(body)


def decode_json(raw: bytes, *, who: str, status: int, secret: str | None = None) -> Any:
    """``raw`` as JSON; a body that is not JSON, or nests too deeply to decode, is the
    server's fault (``ServerError``), never an internal error."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ResponseTooLarge(f"{who}: HTTP {status} body nests JSON too deeply to decode",
                               status=status) from None
    except ValueError:
        snippet = redact(raw[:200].decode(errors="replace"), secret)
        raise ServerError(f"{who}: HTTP {status} body is not JSON: {snippet!r}",
                          status=status) from None


class LineSplitter:
    """Bytes in, text lines out (without their line ending), with a cap per line and in total.

    Used instead of the HTTP clients' own line readers: aiohttp's fails on lines over 128 KB
    with a bare ``ValueError`` and httpx's has no cap at all.
    """

    def __init__(self, *, who: str, max_total: int, max_line: int = MAX_LINE_BYTES) -> None:
        self.who = who
        self.max_total = max_total
        self.max_line = max_line
        self.total = 0
        self._buf = bytearray()

    def feed(self, chunk: bytes) -> list[str]:
        """The lines ``chunk`` completed; raises ``ResponseTooLarge`` past either cap."""
        self.total += len(chunk)
        if self.total > self.max_total:
            raise too_large(self.who, self.max_total, "response stream")
        self._buf += chunk
        lines: list[str] = []
        start = 0
        while (end := self._buf.find(b"\n", start)) >= 0:
            lines.append(self._line(self._buf[start:end]))
            start = end + 1
        del self._buf[:start]
        if len(self._buf) > self.max_line:
            raise too_large(self.who, self.max_line, "a line of the response stream")
        return lines

    def flush(self) -> list[str]:
        """The last line, when the stream did not end with a newline."""
        if not self._buf:
            return []
        line, self._buf = self._line(self._buf), bytearray()
        return [line]

    def _line(self, raw: bytes | bytearray) -> str:
        if len(raw) > self.max_line:
            raise too_large(self.who, self.max_line, "a line of the response stream")
        return bytes(raw).decode("utf-8", errors="replace").rstrip("\r")
