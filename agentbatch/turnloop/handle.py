"""The handle a caller holds on a running batch, whatever engine runs it."""

from __future__ import annotations

import abc
import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

from agentbatch.core.results import AgentResult
from agentbatch.turnloop.progress import BatchProgress


class BatchHandle(abc.ABC):
    """Stream, wait for, inspect and cancel one batch.

    ``results()`` yields each result as its agent finishes. Leaving it early does not stop
    the batch: the handle still owns the work, ``wait()`` still returns every result, and
    ``cancel()`` (or leaving a ``with`` block) stops what remains.
    """

    batch_id: str
    total: int

    @property
    def runs_on(self) -> str:
        """Which engine runs the batch, said at submit and by `agentbatch run`: with
        ``AGENTBATCH_REDIS_URL`` set, a batch goes through Redis without ``redis_url=``."""
        url = getattr(self, "redis_url", None)
        if not url:
            return "embedded (in this process)"
        from agentbatch.core.redis_url import mask_url

        return f"distributed (Redis {mask_url(url)})"

    @abc.abstractmethod
    def results(self, timeout: float | None = None) -> Iterator[AgentResult]:
        """Results in completion order (not input order)."""

    @abc.abstractmethod
    def aresults(self) -> AsyncIterator[AgentResult]:
        """Async form of ``results()``."""

    @abc.abstractmethod
    def status(self) -> dict[str, int]:
        """Counts by agent state, plus ``total`` and ``finished``."""

    @abc.abstractmethod
    def progress(self) -> BatchProgress:
        """A typed snapshot: done, failed by kind, running, awaiting tools, queued, tokens,
        throughput, ETA, the engine. Cheap enough to call every second."""

    @abc.abstractmethod
    def cancel(self) -> None:
        """Stop remaining turns; unfinished agents end with error kind ``cancelled``."""

    def delete(self, *, force: bool = False) -> int:
        """Remove the batch's stored state now (distributed engine: its Redis keys). Not
        offered by the embedded engine, which stores nothing outside this process."""
        raise NotImplementedError(
            f"{type(self).__name__} keeps nothing outside this process: there is nothing to "
            "delete (delete() is for distributed batches, whose state lives in Redis)")

    def wait(self, timeout: float | None = None) -> list[AgentResult]:
        """Every result, in input order."""
        return _in_order(self.results(timeout=timeout), self.total)

    def to_pandas(self, timeout: float | None = None) -> Any:
        """Every result as a pandas ``DataFrame`` (waits like ``wait()``), one row per
        agent indexed by its index (``frame.result_row``). Needs the ``pandas`` extra."""
        from agentbatch.core.frame import results_frame

        return results_frame(self.wait(timeout=timeout))

    async def wait_async(self) -> list[AgentResult]:
        """Async form of ``wait()``."""
        return _in_order([r async for r in self.aresults()], self.total)

    def close(self) -> None:  # noqa: B027 (optional hook, not abstract)
        """Release local resources; cancels the batch if it is still running here."""

    def __enter__(self) -> BatchHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.status().get("finished"):
            self.cancel()
        self.close()

    async def __aenter__(self) -> BatchHandle:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if not self.status().get("finished"):
            self.cancel()
            await asyncio.sleep(0)
        self.close()


def _in_order(results: Any, total: int) -> list[AgentResult]:
    by_index: dict[int, AgentResult] = {}
    for result in results:
        by_index.setdefault(result.index, result)
    return [by_index[i] for i in sorted(by_index)]
