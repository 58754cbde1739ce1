"""A batch's progress as one typed snapshot, the same on both engines (``handle.progress()``).

The embedded engine reads its in-memory agent states. The distributed engine reads Redis
(``distributed_progress.py``). The live displays (``progress_display.py``, ``agentbatch
watch``) render this object and nothing else, so what they show is what a program can read.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

Engine = Literal["embedded", "distributed"]
RATE_WINDOW_S = 30.0  # throughput is measured over this recent window
SLOWEST_SHOWN = 5


@dataclass(frozen=True)
class TokenCounts:
    """Tokens spent so far; ``cached`` is the part of ``prompt`` served from a prefix cache."""

    prompt: int = 0
    cached: int = 0
    completion: int = 0

    @property
    def cache_hit_rate(self) -> float | None:
        """Share of prompt tokens served from cache; None before any prompt token."""
        return self.cached / self.prompt if self.prompt else None


@dataclass(frozen=True)
class SlowAgent:
    """A running agent and how long its current step (model call or tool round) has run."""

    index: int
    seconds: float


@dataclass(frozen=True)
class BatchProgress:
    """Where a batch stands. ``done + failed + running + awaiting_tools + queued == total``
    (``recovering`` agents are counted among the others: they are re-sent ones).

    ``failed`` counts every agent that ended without a valid output, cancelled ones included;
    ``failed_by_kind`` splits it by ``AgentError.kind``. ``running``: a model call in flight
    (embedded: holding an inference slot; distributed: holding a turn lease). ``queued``: the
    rest of the agents that need the model (waiting for a slot or in a queue).
    ``tokens``: embedded, every agent's; distributed, the finished agents' only (a live
    agent's usage sits in its state entry, which a cheap snapshot does not read).
    ``slowest``: the running agents whose current step has run longest; distributed: as
    observed by this reader (a lease first seen by it counts from then: a lower bound).
    """

    batch_id: str
    engine: Engine
    total: int
    done: int
    failed: int
    running: int
    awaiting_tools: int
    queued: int
    recovering: int
    elapsed_s: float
    finished: bool
    failed_by_kind: Mapping[str, int] = field(default_factory=dict)
    tokens: TokenCounts | None = None
    # US dollars spent so far at the batch's ``prices``; None without prices (distributed:
    # the batch's spend in Redis, added by each winning commit, running agents included)
    cost_usd: float | None = None
    # the spend at the end, projected from the cost per reply so far times the turns left
    # (``budget.py`` says how they are estimated); None without prices or before any reply
    projected_cost_usd: float | None = None
    # set (once) when the projection passes ``max_cost_usd``, saying by how much
    budget_warning: str | None = None
    throughput: float | None = None  # agents finished per second, over RATE_WINDOW_S
    eta_s: float | None = None  # seconds left at that throughput; None before any finished
    slowest: tuple[SlowAgent, ...] = ()

    @property
    def completed(self) -> int:
        """Agents that have ended, ok or not."""
        return self.done + self.failed

    def summary(self) -> str:
        """One plain line of the counts, for logs and non-terminal output."""
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(self.failed_by_kind.items()))
        failed = f"{self.failed} failed" + (f" ({kinds})" if kinds else "")
        line = (f"batch {self.batch_id} [{self.engine}]: {self.completed}/{self.total} "
                f"finished: {self.done} done, {failed}, {self.running} running, "
                f"{self.awaiting_tools} awaiting tools, {self.queued} queued")
        if self.recovering:
            line += f", {self.recovering} recovering"
        return line + f"; elapsed {self.elapsed_s:.1f}s"


class Throughput:
    """Agents finished per second over the last ``window_s``, from the samples it is given
    (one per snapshot); with one sample, the average since the start."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, int]] = deque()

    def rate(self, completed: int, elapsed_s: float, now: float | None = None) -> float | None:
        now = time.monotonic() if now is None else now
        self._samples.append((now, completed))
        while len(self._samples) > 2 and now - self._samples[0][0] > self.window_s:
            self._samples.popleft()
        first_t, first_n = self._samples[0]
        if now - first_t >= 1.0 and completed > first_n:
            return (completed - first_n) / (now - first_t)
        if completed and elapsed_s > 0:
            return completed / elapsed_s
        return None


def eta(remaining: int, throughput: float | None) -> float | None:
    """Seconds to finish at ``throughput``; 0 when nothing remains."""
    if remaining <= 0:
        return 0.0
    return remaining / throughput if throughput else None


def slowest(busy_since: Mapping[int, float], now: float,
            n: int = SLOWEST_SHOWN) -> tuple[SlowAgent, ...]:
    """The ``n`` agents whose current step started first."""
    oldest = sorted(busy_since.items(), key=lambda item: item[1])[:n]
    return tuple(SlowAgent(index, round(now - since, 1)) for index, since in oldest)
