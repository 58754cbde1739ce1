"""Turning HTTP failures into the package's ``BackendError`` tree.

Every HTTP backend must classify failures the same way, because the retry layer and the
agent core decide what to do from the class alone (retry, back off, or give up on the turn).
Messages are truncated and scrubbed of the API key: servers sometimes echo the credential.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from email.utils import parsedate_to_datetime

import httpx

from agentbatch.core.errors import (
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    BadRequest,
    RateLimited,
    ServerError,
)

MAX_MESSAGE_CHARS = 500


def redact(text: str, secret: str | None) -> str:
    """Replace every occurrence of ``secret`` (and an obvious prefix of it) with ``***``."""
    if secret:
        text = text.replace(secret, "***")
        if len(secret) > 12:  # partial echoes such as "sk-abc...wxyz"
            text = text.replace(secret[:12], "***")
    return text


def truncate(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit} more chars]"


def parse_retry_after(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """Seconds to wait from ``retry-after-ms`` or ``Retry-After`` (seconds or an HTTP-date).

    Returns None when absent or unparseable; never negative.
    """
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            value = float(ms) / 1000.0
            if math.isfinite(value):
                return max(0.0, value)
        except ValueError:
            pass
    raw = headers.get("retry-after")
    if raw is None:
        return None
    raw = raw.strip()
    try:
        value = float(raw)
    except ValueError:
        pass
    else:
        return max(0.0, value) if math.isfinite(value) else None
    try:
        when = parsedate_to_datetime(raw)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    now = time.time() if now is None else now
    return max(0.0, when.timestamp() - now)


def error_message(body: bytes | str) -> str:
    """The human-readable error a server put in its body, whatever shape it used."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: absurdly nested JSON
        return text.strip()
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            for key in ("message", "detail", "msg", "error"):
                value = err.get(key)
                if isinstance(value, str) and value:
                    return value
                if value is not None and not isinstance(value, dict):
                    return json.dumps(value)
        elif isinstance(err, str) and err:
            return err
        for key in ("message", "detail"):
            if key in data:
                value = data[key]
                return value if isinstance(value, str) else json.dumps(value)
    return text.strip()


def error_for_status(
    status: int,
    headers: Mapping[str, str],
    body: bytes | str,
    *,
    who: str,
    secret: str | None = None,
) -> BackendError:
    """The error for a non-2xx response. ``who`` prefixes the message (backend name)."""
    detail = truncate(redact(error_message(body), secret)) or "(empty body)"
    retry_after = parse_retry_after(headers)
    msg = f"{who}: HTTP {status}: {detail}"
    if status == 429:
        return RateLimited(msg, status=status, retry_after=retry_after)
    if status == 408:
        return BackendTimeout(msg, status=status, retry_after=retry_after)
    if status >= 500:
        return ServerError(msg, status=status, retry_after=retry_after)
    if 300 <= status < 400:
        location = headers.get("location", "?")
        return BadRequest(
            f"{who}: HTTP {status} redirect to {location}; point the backend URL there",
            status=status,
        )
    return BadRequest(msg, status=status)


def error_for_exception(exc: Exception, *, who: str, secret: str | None = None) -> BackendError:
    """The error for an httpx transport failure (no HTTP response at all)."""
    detail = truncate(redact(str(exc) or type(exc).__name__, secret), 200)
    kind = type(exc).__name__
    if isinstance(exc, httpx.TimeoutException):
        return BackendTimeout(f"{who}: timed out ({kind}): {detail}")
    if isinstance(exc, httpx.TransportError):
        return BackendUnavailable(f"{who}: not answering ({kind}): {detail}")
    return BackendUnavailable(f"{who}: request failed ({kind}): {detail}")
