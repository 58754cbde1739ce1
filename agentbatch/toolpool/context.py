"""The per-call context a tool may ask for.

A tool that has side effects (writes a row, sends a message) must not repeat them when an
agent turn is retried or a worker dies and the agent is resumed elsewhere. Declaring a
parameter annotated ``ToolContext`` gives the tool a stable ``idempotency_key`` to dedupe on;
that parameter is injected by the pool and never shown to the model.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ToolContext:
    """Who is calling: enough to build an idempotency key that survives retries."""

    idempotency_key: str
    batch_id: str
    agent_index: int
    turn: int
    call_id: str

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
