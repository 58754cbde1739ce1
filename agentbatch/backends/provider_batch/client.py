"""The seam between the engines and a provider's batch API: submit requests keyed by
``custom_id``, poll with a deadline, fetch results by ``custom_id``, cancel.

Each provider's module (``openai_batch``, ``anthropic_batch``, ``bedrock_batch``) fills in the
wire calls; the checks, polling and matching live here once.
"""

from __future__ import annotations

import abc
import asyncio
import time
from collections.abc import Sequence

from agentbatch.backends.http_session import HttpSession
from agentbatch.backends.provider_batch.types import BatchState, ItemError, ItemResult
from agentbatch.core.errors import BackendTimeout, BatchSpecError
from agentbatch.core.model_io import ModelRequest

DEFAULT_TIMEOUT_S = 60.0  # one HTTP exchange (an upload of a large batch included)
PROBE_TIMEOUT_S = 10.0
MIN_POLL_S = 0.05
MAX_POLL_S = 60.0
# Turns per provider batch the engines send by default (turnloop's ``MAX_ITEMS``): a slow
# request holds only these few.
DEFAULT_MAX_ITEMS = 8


def check_requests(requests: Sequence[tuple[str, ModelRequest]], *, min_items: int = 1,
                   max_items: int | None = None, who: str = "provider batch") -> None:
    """Refuse what the provider would reject, before anything is uploaded: an empty batch,
    fewer than ``min_items`` or more than ``max_items`` requests, and a ``custom_id`` that is
    empty, not a string or repeated (results are matched by it)."""
    if not requests:
        raise BatchSpecError("requests: a provider batch needs at least one request")
    if len(requests) < min_items:
        raise BatchSpecError(f"requests: {who} takes at least {min_items} requests per "
                             f"batch (its quota), got {len(requests)}")
    if max_items is not None and len(requests) > max_items:
        raise BatchSpecError(f"requests: {who} takes at most {max_items} requests per "
                             f"batch (its quota), got {len(requests)}")
    seen: set[str] = set()
    for n, (custom_id, _) in enumerate(requests):
        if not isinstance(custom_id, str) or not custom_id:
            raise BatchSpecError(f"requests[{n}]: custom_id must be a non-empty string, "
                                 f"got {custom_id!r}")
        if custom_id in seen:
            raise BatchSpecError(f"requests[{n}]: custom_id {custom_id!r} is repeated")
        seen.add(custom_id)


class ProviderBatchClient(abc.ABC):
    """One provider's batch API on one server."""

    name: str
    session: HttpSession
    timeout: float = DEFAULT_TIMEOUT_S
    # How many requests a caller puts in one batch: at least ``min_items`` (the provider's
    # minimum; fewer ready turns go to the sync API) and at most ``max_items`` (the engines'
    # choice, ``DEFAULT_MAX_ITEMS``, unless the provider needs bigger batches).
    # ``submit`` refuses fewer than ``min_items`` and more than ``quota_max_items`` (the
    # provider's hard cap, None where it is not known).
    min_items: int = 1
    max_items: int = DEFAULT_MAX_ITEMS
    quota_max_items: int | None = None

    @abc.abstractmethod
    async def discover(self) -> bool:
        """Whether the server has this batch API (asked once, at warm-up)."""

    @abc.abstractmethod
    async def _submit(self, requests: Sequence[tuple[str, ModelRequest]]) -> BatchState:
        ...

    @abc.abstractmethod
    async def state(self, batch_id: str) -> BatchState:
        """The batch as the provider reports it now."""

    @abc.abstractmethod
    async def _results(self, batch_id: str) -> dict[str, ItemResult]:
        ...

    @abc.abstractmethod
    async def cancel(self, batch_id: str) -> BatchState:
        """Ask the provider to stop the batch; requests already answered keep their answer."""

    async def submit(self, requests: Sequence[tuple[str, ModelRequest]]) -> BatchState:
        """Send ``(custom_id, request)`` pairs as one provider batch; its state on creation."""
        check_requests(requests, min_items=self.min_items, max_items=self.quota_max_items,
                       who=self.name)
        return await self._submit(requests)

    async def results(self, batch_id: str, custom_ids: Sequence[str]) -> dict[str, ItemResult]:
        """Every one of ``custom_ids`` -> its result, once the batch has ended. A request the
        provider's results do not name is a ``missing`` error, not left out."""
        found = await self._results(batch_id)
        return {cid: found.get(cid) or ItemResult(cid, error=ItemError(
                    "missing", f"{self.name}: batch {batch_id} ended without a result for it"))
                for cid in custom_ids}

    async def wait(self, batch_id: str, *, timeout_s: float,
                   poll_s: float = 1.0) -> BatchState:
        """Poll until the batch has ended; ``BackendTimeout`` after ``timeout_s`` (the batch
        is left running: cancel it, or keep waiting). Polls back off from ``poll_s``."""
        deadline = time.monotonic() + timeout_s
        delay = max(MIN_POLL_S, poll_s)
        while True:
            state = await self.state(batch_id)
            if state.ended:
                return state
            left = deadline - time.monotonic()
            if left <= 0:
                raise BackendTimeout(f"{self.name}: batch {batch_id} still {state.status} "
                                     f"after {timeout_s:g}s")
            await asyncio.sleep(min(delay, left))
            delay = min(delay * 1.5, MAX_POLL_S)

    async def aclose(self) -> None:
        await self.session.aclose()
