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

from agentbatch.distributed.state.cancel_safe import CancelSafeSend

_SERIALIZER = HiredisRespSerializer()


class HiredisPacking:
    """Mixin for a ``redis.asyncio`` connection class: ``pack_command`` by hiredis."""

    def pack_command(self, *args: Any) -> list[bytes]:
        if not HIREDIS_AVAILABLE:  # the sentinel class carries the mixin unconditionally
            return super().pack_command(*args)  # type: ignore[misc]
        return _SERIALIZER.pack(*args)


class HiredisConnection(CancelSafeSend, HiredisPacking, aioconn.Connection):
    pass


class HiredisSSLConnection(CancelSafeSend, HiredisPacking, aioconn.SSLConnection):
    pass


class HiredisUnixConnection(CancelSafeSend, HiredisPacking, aioconn.UnixDomainSocketConnection):
    pass


_BY_SCHEME = {"redis": HiredisConnection, "rediss": HiredisSSLConnection,
              "unix": HiredisUnixConnection}


def connection_class(scheme: str) -> type[aioconn.AbstractConnection] | None:
    """Our connection class for a URL scheme: packing by hiredis when it is installed (else
    redis-py's own packer), and never swallowing a cancel (``cancel_safe.py``)."""
    return _BY_SCHEME.get(scheme)
