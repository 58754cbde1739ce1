"""The systems agentbatch is compared with, each run against the same simulator and workload.

Every runner is ``async def run(base_url, workload, agents, counter) -> RunOutcome``; the
benchmark driver times it and reads the simulator's counters around it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RunOutcome:
    """What a system reports about one batch (timing and sim counters are added by the driver)."""

    agents: int
    ok: int
    errors: list[str] = field(default_factory=list)  # first few, for diagnosis
    tool_calls: int | None = None  # tool calls the agents made, as the system reports them
    tool_calls_shared: int | None = None  # of those, served by cache or coalescing
    extra: dict[str, Any] = field(default_factory=dict)

    def add_error(self, message: str, keep: int = 5) -> None:
        if len(self.errors) < keep:
            self.errors.append(message[:300])
