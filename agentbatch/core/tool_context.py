"""The per-call context a tool may ask for, and the lease its execution runs under.

A tool that has side effects (writes a row, sends a message) must not repeat them when an
agent turn is retried or a worker dies and the agent is resumed elsewhere. Declaring a
parameter annotated ``ToolContext`` gives the tool a stable ``idempotency_key`` to dedupe on;
that parameter is injected by the pool and never shown to the model.

Tool execution is at-least-once: a worker paused past its lock (GC pause, SIGSTOP, VM freeze)
wakes up still running the tool while another worker has taken over. ``fencing_token`` grows
every time leadership of a call is taken, so a store that remembers the highest token it saw
per key can refuse the stale writer; ``still_leader()`` asks whether we still hold the lock.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

__all__ = ["Lease", "LocalLease", "ToolContext"]


@runtime_checkable
class Lease(Protocol):
    """Leadership of one tool execution: its fencing token and whether it is still held."""

    @property
    def fencing_token(self) -> int: ...

    async def still_held(self) -> bool: ...


_local_tokens = itertools.count(1)


@dataclass(frozen=True)
class LocalLease:
    """In-process leadership (embedded engine): nobody else can take it over, so it holds."""

    fencing_token: int = field(default_factory=lambda: next(_local_tokens))

    async def still_held(self) -> bool:
        return True


@dataclass(frozen=True)
class ToolContext:
    """Who is calling: enough to build an idempotency key that survives retries.

    ``fencing_token`` and ``still_leader()`` describe the execution this call runs in; the
    pool fills them in when it starts the tool (0 and True outside a pool).
    """

    idempotency_key: str
    batch_id: str
    agent_index: int
    turn: int
    call_id: str
    fencing_token: int = 0
    lease: Lease | None = field(default=None, repr=False, compare=False)

    @classmethod
    def for_call(cls, batch_id: str, agent_index: int, turn: int, call_id: str) -> ToolContext:
        """The default key: the same (batch, agent, turn, call) always maps to the same key."""
        return cls(
            idempotency_key=f"{batch_id}:{agent_index}:{turn}:{call_id}",
            batch_id=batch_id,
            agent_index=agent_index,
            turn=turn,
            call_id=call_id,
        )

    def under(self, lease: Lease) -> ToolContext:
        """This context as seen by an execution running under ``lease``."""
        return replace(self, fencing_token=lease.fencing_token, lease=lease)

    async def still_leader(self) -> bool:
        """Whether this execution still holds its call's lock (check before a side effect).

        False means another worker has taken the call over after our lock expired: our
        result will be discarded and our writes should be refused (use ``fencing_token``).
        """
        return True if self.lease is None else await self.lease.still_held()
