"""Reuse one synchronous Redis client per kombu channel.

kombu's Redis channel builds a new ``redis.Redis`` object (around the same connection pool)
for every ack and publish made while its main connection is blocked in BRPOP, and with
redis-py 8 each construction copies the response-callback table. A redis-py client is
thread-safe (each command checks a connection out of the pool), so one cached client per
channel is equivalent and removes that cost. Applied only in worker processes; the cost
measured: docs/design-notes.md.
"""

from __future__ import annotations

from typing import Any

from kombu.transport import redis as kombu_redis

_ATTR = "_agentbatch_sync_client"
_original = kombu_redis.Channel._create_client  # type: ignore[attr-defined]  # private; not in celery-types


def _create_client(self: Any, asynchronous: bool = False) -> Any:
    if asynchronous:
        return _original(self, asynchronous=True)
    client = self.__dict__.get(_ATTR)
    if client is None:
        client = self.__dict__[_ATTR] = _original(self, asynchronous=False)
    return client


def install() -> None:
    kombu_redis.Channel._create_client = _create_client  # type: ignore[attr-defined]  # (as above)
