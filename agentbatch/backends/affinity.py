"""Which endpoint of a pool an agent belongs on: rendezvous (highest-random-weight) hashing.

Every process that knows the same endpoint names ranks them the same way for a given agent
key, with no coordination: two workers of a distributed batch send an agent's turns to the
same server, so its conversation stays in that server's prefix cache. Removing an endpoint
(ejected) moves only the agents whose first choice it was, each to its own second choice;
the others keep their server.

A few lines of hashing rather than a dependency: blake2b of ``endpoint name + agent key``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence


def _weight(endpoint: str, key: str) -> int:
    digest = hashlib.blake2b(f"{endpoint}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rank(key: str, endpoints: Sequence[str]) -> list[int]:
    """Indices of ``endpoints`` in the order ``key`` prefers them (first = its home)."""
    return sorted(range(len(endpoints)), key=lambda i: _weight(endpoints[i], key), reverse=True)


def load_bound(total_outstanding: int, endpoints: int, factor: float, floor: int) -> int:
    """How many requests in flight an endpoint may hold before an agent whose home it is
    goes elsewhere (consistent hashing with bounded loads): ``factor`` times the mean load
    including the request being routed, never below ``floor`` (a lightly used pool never
    moves anyone)."""
    mean = (total_outstanding + 1) / max(1, endpoints)
    return max(floor, math.ceil(factor * mean))


def spread(key: str, endpoints: int) -> int | None:
    """Which of ``endpoints`` a fleet places agent ``key``'s first turn on: agent ``i`` of a
    batch on ``(i + offset) % endpoints``, the offset a hash of the batch id. Every process
    places an agent alike, and a batch's agents split evenly (each endpoint within one of
    ``agents / endpoints``) with no counts shared; the offset keeps small batches on a shared
    fleet from all starting on the first endpoint. ``key`` is
    ``model_io.agent_key(batch_id, index)``; None for any other key (the warm-up's)."""
    batch, _, number = key.rpartition(":")
    if not batch or not number.isdigit() or endpoints < 1:
        return None
    return (int(number) + _weight("spread", batch)) % endpoints
