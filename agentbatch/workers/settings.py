"""Worker-side tunables, read from ``AGENTBATCH_*`` environment variables at the edge."""

from __future__ import annotations

import os
from dataclasses import dataclass


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    return float(raw) if raw else default


@dataclass(frozen=True)
class WorkerSettings:
    redis_url: str
    lease_ttl_s: float = 30.0
    """How long a turn's lease lives without renewal; a dead worker's agent resumes after it."""
    queue_grace_s: float = 120.0
    """How long a queued follow-up may wait before the sweep assumes it was lost and re-sends
    it (duplicates are harmless: versioned state drops them)."""
    sweep_interval_s: float = 2.0
    """How often some worker runs the recovery sweep (one at a time, fleet-wide)."""
    consumer_stall_s: float = 60.0
    """Exit (for the supervisor to restart) a worker whose consumer fetched nothing for this
    long while its queues held messages and it had free slots; 0 disables the watchdog."""
    audit: bool = False
    """Append (agent, version) of every commit to a stream, for the chaos harness."""

    @classmethod
    def from_env(cls, redis_url: str | None = None) -> WorkerSettings:
        return cls(
            redis_url=redis_url or os.environ.get("AGENTBATCH_REDIS_URL",
                                                  "redis://127.0.0.1:6379/0"),
            lease_ttl_s=_env_float("AGENTBATCH_LEASE_TTL_S", cls.lease_ttl_s),
            queue_grace_s=_env_float("AGENTBATCH_QUEUE_GRACE_S", cls.queue_grace_s),
            sweep_interval_s=_env_float("AGENTBATCH_SWEEP_INTERVAL_S", cls.sweep_interval_s),
            consumer_stall_s=_env_float("AGENTBATCH_CONSUMER_STALL_S", cls.consumer_stall_s),
            audit=os.environ.get("AGENTBATCH_AUDIT", "") in ("1", "true", "yes"),
        )

    @property
    def lease_ttl_ms(self) -> int:
        return int(self.lease_ttl_s * 1000)

    @property
    def queue_grace_ms(self) -> int:
        return int(self.queue_grace_s * 1000)
