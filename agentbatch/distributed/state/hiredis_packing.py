"""Commands packed by hiredis on redis-py's asyncio connections.

redis-py packs a command with hiredis on its sync connections but in pure Python on its
asyncio ones, and every worker step is an EVALSHA with many arguments, so the pure-Python
packer shows in a worker's profile (docs/design-notes.md). These connection classes use the
sync client's own hiredis serializer instead.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio.connection as aioconn
from redis.connection import HiredisRespSerializer
from redis.utils import HIREDIS_AVAILABLE

_SERIALIZER = HiredisRespSerializer()


class HiredisPacking:
    """Mixin for a ``redis.asyncio`` connection class: ``pack_command`` by hiredis."""

    def pack_command(self, *args: Any) -> list[bytes]:
        if not HIREDIS_AVAILABLE:  # the sentinel class carries the mixin unconditionally
            return super().pack_command(*args)  # type: ignore[misc]
        return _SERIALIZER.pack(*args)


class HiredisConnection(HiredisPacking, aioconn.Connection):
    pass


class HiredisSSLConnection(HiredisPacking, aioconn.SSLConnection):
    pass


class HiredisUnixConnection(HiredisPacking, aioconn.UnixDomainSocketConnection):
    pass


_BY_SCHEME = {"redis": HiredisConnection, "rediss": HiredisSSLConnection,
              "unix": HiredisUnixConnection}


def connection_class(scheme: str) -> type[aioconn.AbstractConnection] | None:
    """The hiredis-packing class for a URL scheme (None: hiredis missing, keep redis-py's)."""
    return _BY_SCHEME.get(scheme) if HIREDIS_AVAILABLE else None
