"""The few HTTP exchanges a provider batch client makes, errors mapped as every driver maps
them (``http_errors``): a failed call is a ``BackendError``, never an httpx exception."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from agentbatch.backends.http_errors import error_for_exception, error_for_status
from agentbatch.backends.http_session import HttpSession
from agentbatch.core.errors import BackendTimeout
from agentbatch.core.wait_for import wait_for


async def call(session: HttpSession, method: str, path: str, *, timeout: float,
               **kwargs: Any) -> httpx.Response:
    """``method path`` on ``session``'s client; a 2xx response (read) or the mapped error.
    ``timeout`` bounds the whole exchange."""
    client = session.client()
    session.requests_sent += 1
    try:
        resp = await wait_for(
            client.request(method, session.base_url + path, timeout=timeout, **kwargs), timeout)
    except asyncio.TimeoutError:
        raise BackendTimeout(f"{session.who}: no answer to {method} {path} within "
                             f"{timeout:g}s") from None
    except httpx.HTTPError as exc:
        raise error_for_exception(exc, who=session.who, secret=session.secret) from None
    if not 200 <= resp.status_code < 300:
        raise error_for_status(resp.status_code, resp.headers, resp.content, who=session.who,
                               secret=session.secret)
    return resp


async def answers(session: HttpSession, path: str, timeout: float) -> bool:
    """Whether ``GET path`` answers 200: how a client finds out the server has an API."""
    return await session.get_status(path, timeout) == 200
