"""Classification of HTTP failures, Retry-After parsing and key redaction."""

from __future__ import annotations

import httpx
import pytest

from agentbatch.backends.http_errors import (
    error_for_exception,
    error_for_status,
    error_message,
    parse_retry_after,
    redact,
)
from agentbatch.core.errors import (
    BackendTimeout,
    BackendUnavailable,
    BadRequest,
    RateLimited,
    ServerError,
)

NOW = 1_700_000_000.0


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({"retry-after": "3"}, 3.0),
        ({"retry-after": "0.25"}, 0.25),
        ({"retry-after": " 2 "}, 2.0),
        ({"retry-after": "-5"}, 0.0),
        ({"retry-after": "soon"}, None),
        ({"retry-after": "inf"}, None),
        ({"retry-after-ms": "1500", "retry-after": "9"}, 1.5),
        ({"retry-after-ms": "junk", "retry-after": "9"}, 9.0),
        ({}, None),
        # HTTP-dates: 30 s after NOW, and one in the past.
        ({"retry-after": "Tue, 14 Nov 2023 22:13:50 GMT"}, 30.0),
        ({"retry-after": "Tue, 14 Nov 2023 22:00:00 GMT"}, 0.0),
    ],
)
def test_parse_retry_after(headers: dict[str, str], expected: float | None) -> None:
    assert parse_retry_after(headers, now=NOW) == expected


def test_parse_retry_after_is_case_insensitive_on_httpx_headers() -> None:
    assert parse_retry_after(httpx.Headers({"Retry-After": "4"})) == 4.0


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ('{"error": {"message": "bad tools"}}', "bad tools"),
        ('{"error": "plain"}', "plain"),
        ('{"object": "error", "message": "ctx too long"}', "ctx too long"),
        ('{"detail": [{"loc": ["body"], "msg": "field required"}]}', '[{"loc": ["body"]'),
        ("upstream connect error", "upstream connect error"),
        (b"\xff bytes", "\ufffd bytes"),
    ],
)
def test_error_message_shapes(body: str | bytes, expected: str) -> None:
    assert error_message(body).startswith(expected)


@pytest.mark.parametrize(
    ("status", "cls"),
    [
        (429, RateLimited),
        (500, ServerError),
        (502, ServerError),
        (503, ServerError),
        (408, BackendTimeout),
        (400, BadRequest),
        (401, BadRequest),
        (404, BadRequest),
        (422, BadRequest),
        (307, BadRequest),
    ],
)
def test_error_for_status(status: int, cls: type) -> None:
    err = error_for_status(status, {"retry-after": "2"}, b'{"error": "x"}', who="vllm://h:1")
    assert type(err) is cls
    assert err.status == status
    assert str(err).startswith("vllm://h:1")


def test_server_error_keeps_retry_after() -> None:
    err = error_for_status(503, {"retry-after": "7"}, b"", who="b")
    assert err.retry_after == 7.0 and "(empty body)" in str(err)


def test_redaction_of_full_and_partial_key() -> None:
    key = "sk-proj-abcdefghijklmnopqrstuvwxyz"
    err = error_for_status(
        401, {}, f'{{"error": "bad key {key} (starts {key[:14]}...)"}}', who="b", secret=key
    )
    assert key not in str(err) and key[:12] not in str(err)
    assert redact("nothing here", None) == "nothing here"


@pytest.mark.parametrize(
    ("exc", "cls"),
    [
        (httpx.ConnectError("refused"), BackendUnavailable),
        (httpx.RemoteProtocolError("closed"), BackendUnavailable),
        (httpx.ReadError("reset"), BackendUnavailable),
        (httpx.WriteError("broken pipe"), BackendUnavailable),
        (httpx.ReadTimeout("slow"), BackendTimeout),
        (httpx.ConnectTimeout("slow"), BackendTimeout),
        (httpx.PoolTimeout("busy"), BackendTimeout),
    ],
)
def test_error_for_exception(exc: Exception, cls: type) -> None:
    err = error_for_exception(exc, who="b")
    assert type(err) is cls and err.retryable
