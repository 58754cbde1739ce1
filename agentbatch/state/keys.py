"""Every Redis key agentbatch uses, in one place.

A batch's keys share the hash tag ``{batch_id}`` so multi-key scripts stay on one cluster slot.
"""

from __future__ import annotations

PREFIX = "ab"
ACTIVE_BATCHES = f"{PREFIX}:batches"  # set of batch ids the recovery sweep watches
SWEEP_LOCK = f"{PREFIX}:sweep:lock"  # one sweeper at a time, fleet-wide
TOOL_DONE_CHANNEL = f"{PREFIX}:tool:done"  # pub/sub: "<key hash>:<token>" when a leader finishes
DEAD_LETTERS = f"{PREFIX}:deadletter"  # list: queue messages no worker could decode
TOMBSTONE_S = 30 * 24 * 3600  # how long a batch's ``gone`` key outlives its retention


class BatchKeys:
    """Keys of one batch."""

    def __init__(self, batch_id: str) -> None:
        base = f"{PREFIX}:{{{batch_id}}}"
        self.batch_id = batch_id
        self.plan = f"{base}:plan"  # string: the BatchPlan JSON
        self.meta = f"{base}:meta"  # hash: total, delivered, cancelled, n:<status> counters
        self.state = f"{base}:state"  # hash: index -> AgentState JSON
        self.ver = f"{base}:ver"  # hash: index -> version (the fencing token)
        self.watch = f"{base}:watch"  # zset: index -> progress deadline (ms)
        self.results = f"{base}:results"  # stream: one entry per finished agent
        self.audit = f"{base}:audit"  # stream: (index, version) per commit, when auditing
        self.resends = f"{base}:resends"  # hash: index -> "version:n" re-sends without progress
        self.run = f"{base}:run"  # hash: index -> the version last started (claim / tool)
        # string: why the batch's keys went (expired after retention, or deleted); outlives
        # them by TOMBSTONE_S so a late reader gets ``BatchExpired``, not ``BatchLost``
        self.gone = f"{base}:gone"
        self._base = base

    def retained(self) -> list[str]:
        """Every fixed key the finishing commit gives the retention TTL (leases carry their own
        TTL; tool fan-in hashes are deleted by the commit that consumes them)."""
        return [self.plan, self.meta, self.state, self.ver, self.watch, self.results,
                self.audit, self.resends, self.run]

    def pattern(self) -> str:
        """SCAN pattern matching every key of this batch, the tombstone included."""
        escaped = "".join("\\" + c if c in "*?[]\\" else c for c in self._base)
        return f"{escaped}:*"

    def lease(self, index: int) -> str:
        return f"{self._base}:lease:{index}"

    def tool_results(self, index: int, version: int) -> str:
        return f"{self._base}:tr:{index}:{version}"



def tool_lock(key_hash: str) -> str:
    return f"{PREFIX}:tool:{key_hash}:lock"


def tool_result(key_hash: str, token: str) -> str:
    return f"{PREFIX}:tool:{key_hash}:res:{token}"


def tool_fence(key_hash: str) -> str:
    """Counter: the fencing token handed to each successive leader of one call."""
    return f"{PREFIX}:tool:{key_hash}:fence"


def tool_cache(key_hash: str) -> str:
    return f"{PREFIX}:tool:{key_hash}:cache"


def semaphore(name: str) -> str:
    return f"{PREFIX}:sem:{name}"
