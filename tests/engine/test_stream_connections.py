"""Streamed turns on the real engine never fail on a connection llama-server has dropped.

This llama-server build ends every streamed (SSE) response by closing its connection without
saying so: its stream provider returns false after the last chunk, which cpp-httplib takes as
a cancelled write, so no ``Connection: close`` header goes out. A client that pools the
connection races the close, and the next request on it fails (``ServerDisconnectedError`` or
"Can not write request body"): about half of 60 streamed requests from 4 concurrent callers
did, and SmolLM2 demo agents ended ``backend_unavailable`` after three such attempts.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agentbatch.backends.llamacpp import LlamaCppBackend
from agentbatch.core.errors import BackendError
from agentbatch.core.model_io import ModelRequest

pytestmark = pytest.mark.engine

CALLERS = 4
TURNS_EACH = 15


def _request(caller: int, turn: int) -> ModelRequest:
    return ModelRequest(model="smollm2", max_tokens=40, temperature=0.0,
                        messages=[{"role": "user",
                                   "content": f"Tell story {caller}-{turn} about a kettle."}])


async def _streamed_turns(url: str) -> tuple[int, list[str]]:
    """(turns answered, transport errors) of CALLERS x TURNS_EACH streamed turns, each caller
    sending its next turn as soon as the last one ends, on one backend (one connection pool),
    with no retries in between."""
    backend = LlamaCppBackend(url, stream=True)
    answered, errors = 0, []

    async def caller(c: int) -> None:
        nonlocal answered
        for t in range(TURNS_EACH):
            try:
                resp = await backend.complete(_request(c, t))
            except BackendError as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
            else:
                answered += bool(resp.text)

    try:
        await asyncio.gather(*(caller(c) for c in range(CALLERS)))
    finally:
        await backend.aclose()
    return answered, errors


def test_concurrent_streamed_turns_never_reuse_a_dropped_connection(llama_server: Any) -> None:
    answered, errors = asyncio.run(_streamed_turns(llama_server.llamacpp_url))
    assert errors == [], f"{len(errors)} of {CALLERS * TURNS_EACH} turns failed: {errors[:3]}"
    assert answered == CALLERS * TURNS_EACH
