"""The workers' asyncio Redis clients pack commands with hiredis, and say the same thing."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio.connection as aioconn

from agentbatch.distributed.state.connection import async_client
from agentbatch.distributed.state.hiredis_packing import HiredisPacking

pytestmark = pytest.mark.redis


def test_async_client_packs_with_hiredis_exactly_as_redis_py_does(redis_url: str) -> None:
    args = ("EVALSHA", "ab", 2, "k:{x}", b"\x00bin", 1.5, -7, "é" * 3, "x" * 70_000)
    pure = aioconn.Connection().pack_command(*args)

    async def run() -> tuple[object, list[bytes], object]:
        client = async_client(redis_url)
        try:
            conn = client.connection_pool.make_connection()
            packed = conn.pack_command(*args)
            await client.set("k", "é" * 3)
            await client.rpush("l", 1, 2.5, b"b")
            got = (await client.get("k"), await client.lrange("l", 0, -1))
            return conn, packed, got
        finally:
            await client.aclose()

    conn, packed, got = asyncio.run(run())
    assert isinstance(conn, HiredisPacking)
    assert b"".join(packed) == b"".join(bytes(p) for p in pure)  # byte for byte
    assert got == ("ééé", ["1", "2.5", "b"])
