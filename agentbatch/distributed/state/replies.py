"""Replies of this package's Redis clients, typed as what they are at run time.

redis-py annotates replies for both of its modes (``bytes | str`` keys and values, ``None``
for an entry that cannot be, a dict for RESP3 stream reads). Every client here is made by
``distributed/state/connection.py`` with ``decode_responses=True`` on RESP2, so a reply
holds ``str``.
These functions say so once, at the edge, instead of each reader narrowing it again; they
return the reply itself (no copy, no check: a hot path reads through them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

Fields = dict[str, str]  # a hash, or one stream entry's fields
Entries = Sequence[tuple[str, Fields]]  # (stream id, fields), in stream order


def range_entries(reply: Any) -> list[tuple[str, Fields]]:
    """The entries of an XRANGE / XREVRANGE reply."""
    return cast("list[tuple[str, Fields]]", reply)


def read_entries(reply: Any) -> list[tuple[str, Fields]]:
    """The entries of an XREAD reply on one stream (none when it timed out)."""
    return range_entries(reply[0][1]) if reply else []


def str_hash(reply: Any) -> Fields:
    """An HGETALL reply."""
    return cast("Fields", reply)


def str_values(reply: Any) -> list[str | None]:
    """An HMGET / MGET reply (``None`` for a missing field or key)."""
    return cast("list[str | None]", reply)


def str_list(reply: Any) -> list[str]:
    """An LRANGE reply."""
    return cast("list[str]", reply)
