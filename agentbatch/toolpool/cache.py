"""Result cache for cacheable tools.

The protocol is async so a Redis-backed cache shared by a fleet of workers can implement it;
``TTLCache`` is the in-process default: bounded (LRU) so a 10,000-agent batch cannot grow it
without limit, and with a TTL so stale answers age out. It is thread-safe: embedded batches run
on their own threads and share one cache for ``share="fleet"`` tools.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol, runtime_checkable

__all__ = ["ResultCache", "TTLCache"]


@runtime_checkable
class ResultCache(Protocol):
    """Maps a call key (``ToolPool.call_key``: scope, tool identity, arguments) to its text."""

    async def get(self, key: str) -> str | None: ...

    async def set(self, key: str, value: str, ttl: float | None = None) -> None: ...


class TTLCache:
    """An in-process LRU cache whose entries also expire ``ttl`` seconds after being set."""

    def __init__(self, max_entries: int = 10_000, ttl: float | None = 3600.0, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.max_entries = max_entries
        self.ttl = ttl  # default when ``set`` gets none; None = no expiry
        self._clock = clock
        self._data: OrderedDict[str, tuple[str, float | None]] = OrderedDict()
        self._lock = threading.Lock()

    async def get(self, key: str) -> str | None:
        return self.get_nowait(key)

    async def set(self, key: str, value: str, ttl: float | None = None) -> None:
        self.set_nowait(key, value, ttl)

    def get_nowait(self, key: str) -> str | None:
        """The value, or None if absent or expired; a hit becomes the most recently used."""
        with self._lock:
            entry = self._data.get(key)
            if entry is None:
                return None
            value, expires = entry
            if expires is not None and self._clock() >= expires:
                del self._data[key]
                return None
            self._data.move_to_end(key)
            return value

    def set_nowait(self, key: str, value: str, ttl: float | None = None) -> None:
        """Store ``value``; evicts the least recently used entries beyond ``max_entries``."""
        ttl = self.ttl if ttl is None else ttl
        expires = None if ttl is None else self._clock() + ttl
        with self._lock:
            self._data[key] = (value, expires)
            self._data.move_to_end(key)
            while len(self._data) > self.max_entries:
                self._data.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.get_nowait(key) is not None
