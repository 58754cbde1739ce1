"""Worker-side tunables, read from ``AGENTBATCH_*`` environment variables at the edge."""

from __future__ import annotations

import os
from dataclasses import dataclass

from agentbatch.core.errors import ConfigError
from agentbatch.core.import_allowlist import WORKER_IMPORTS_ENV, parse_import_prefixes
from agentbatch.distributed.state.redis_store import DEFAULT_RETENTION_S

RETENTION_ENV = "AGENTBATCH_RETENTION_S"
REDIS_URL_ENV = "AGENTBATCH_REDIS_URL"

# The URL ``agentbatch worker`` was started with. Kept here, never in os.environ: everything
# the worker runs (tools, their subprocesses) can read its environment. Prefork children are
# forked after it is set, so they inherit it.
_process_redis_url: str | None = None


def use_redis_url(url: str) -> None:
    """Set the Redis URL this worker process connects to, and remove ``AGENTBATCH_REDIS_URL``
    (and its password) from the environment that tools and their subprocesses inherit.

    Every later reading of settings (``WorkerSettings.from_env``) takes this one first."""
    global _process_redis_url
    _process_redis_url = url
    os.environ.pop(REDIS_URL_ENV, None)


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    return float(raw) if raw else default


def retention_from_env() -> float:
    """``AGENTBATCH_RETENTION_S``: seconds a finished batch's keys stay in Redis.

    Refused unless a finite number > 0: 0 would delete the results the moment the batch
    finishes, before a waiting reader has seen the last of them."""
    raw = os.environ.get(RETENTION_ENV, "").strip()
    if not raw:
        return DEFAULT_RETENTION_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (value > 0 and value != float("inf")):
        raise ConfigError(f"{RETENTION_ENV}={raw!r}: must be a number of seconds > 0 "
                          f"(default {DEFAULT_RETENTION_S:.0f}, 7 days)")
    return value


@dataclass(frozen=True)
class WorkerSettings:
    redis_url: str
    lease_ttl_s: float = 30.0
    """How long a turn's lease lives without renewal; a dead worker's agent resumes after it."""
    queue_grace_s: float = 30.0
    """How long after a commit the sweep first checks an agent whose next task has not
    started: it re-sends if that task's queue is empty (the message is gone), else it lets
    it wait once more, and re-sends at the latest ``sweep.QUEUED_GRACES`` (3) graces after
    the commit. A started turn or tool call is recovered at lease expiry instead."""
    max_resends: int = 8
    """Re-sends of one agent at one version without progress before it is ended with an
    ``internal`` error: no fault or bug loops the fleet on one agent forever."""
    sweep_interval_s: float = 2.0
    """How often some worker runs the recovery sweep (one at a time, fleet-wide)."""
    consumer_stall_s: float = 60.0
    """Exit (for the supervisor to restart) a worker whose consumer fetched nothing for this
    long while its queues held messages and it had free slots; 0 disables the watchdog."""
    retention_s: float = DEFAULT_RETENTION_S
    """How long a finished batch's keys stay in Redis (``AGENTBATCH_RETENTION_S``); set with
    the batch at submit, this worker's value only applies to batches submitted without one."""
    audit: bool = False
    """Append (agent, version) of every commit to a stream, for the chaos harness."""
    worker_imports: tuple[str, ...] = ()
    """Module prefixes this worker may import tools and output schemas from
    (``AGENTBATCH_WORKER_IMPORTS=mypkg.tools,agentbatch.toolpool.builtins``). A plan in Redis
    names what to import, and importing runs code, so nothing else is imported; empty means
    nothing is (``agentbatch worker`` refuses to start without it)."""

    @classmethod
    def from_env(cls, redis_url: str | None = None) -> WorkerSettings:
        return cls(
            redis_url=redis_url or _process_redis_url
            or os.environ.get(REDIS_URL_ENV, "redis://127.0.0.1:6379/0"),
            lease_ttl_s=_env_float("AGENTBATCH_LEASE_TTL_S", cls.lease_ttl_s),
            queue_grace_s=_env_float("AGENTBATCH_QUEUE_GRACE_S", cls.queue_grace_s),
            max_resends=int(_env_float("AGENTBATCH_MAX_RESENDS", cls.max_resends)),
            sweep_interval_s=_env_float("AGENTBATCH_SWEEP_INTERVAL_S", cls.sweep_interval_s),
            consumer_stall_s=_env_float("AGENTBATCH_CONSUMER_STALL_S", cls.consumer_stall_s),
            retention_s=retention_from_env(),
            audit=os.environ.get("AGENTBATCH_AUDIT", "") in ("1", "true", "yes"),
            worker_imports=parse_import_prefixes(os.environ.get(WORKER_IMPORTS_ENV, "")),
        )

    @property
    def lease_ttl_ms(self) -> int:
        return int(self.lease_ttl_s * 1000)

    @property
    def queue_grace_ms(self) -> int:
        return int(self.queue_grace_s * 1000)
