"""An agent whose stored state cannot be read (written by another version, or damaged).

Such an agent can never run again, so it is ended with an ``internal`` error: the claim that
finds it (or, when its message is lost, the sweep) commits a placeholder state at the stored
version, built from what little still reads, and the batch finishes. Retrying it would only
fail the same way on every worker, for ever.
"""

from __future__ import annotations

import json
from typing import Any

from agentbatch.core.agent_state import AgentState, AgentStatus


def damage_reason(exc: BaseException) -> str:
    """The error message for an agent whose state failed to parse with ``exc``."""
    detail = str(exc).splitlines()[0][:300] if str(exc) else ""
    return (f"the agent's stored state cannot be read ({type(exc).__name__}: {detail}); "
            "it was written by another version of agentbatch or damaged")


def placeholder_state(index: int, entry: str) -> AgentState:
    """A state to commit the agent's end from: the stored version, and its input and status
    when those still read (the status decides which counts the commit moves)."""
    version, _, raw = entry.partition(":")
    fields: dict[str, Any] = {}
    try:
        loaded = json.loads(raw)
        if isinstance(loaded, dict):
            fields = loaded
    except ValueError:
        pass
    given = fields.get("input")
    status = fields.get("status")
    return AgentState(
        index=index, version=int(version), input=given if isinstance(given, dict) else {},
        status=AgentStatus(status) if status in {s.value for s in AgentStatus}
        else AgentStatus.NEEDS_MODEL)
