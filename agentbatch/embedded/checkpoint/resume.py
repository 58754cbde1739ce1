"""Which agents run again on a re-run, and from where (pure: no IO).

BatchAgent treated a failed agent as finished on resume; here a failure is retried from the
start unless the caller keeps it (``retry_failed=False``). An agent that ended ``done`` is
never run again. An agent that had not ended continues from its last committed state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from agentbatch.core.agent_state import AgentState, AgentStatus
from agentbatch.embedded.checkpoint.store import SavedAgent


@dataclass
class Resumed:
    """Every agent's starting state, in index order, and what the checkpoint gave."""

    states: list[AgentState]
    # agents that ended in an earlier run and are not run again: their latency then
    ended: dict[int, float | None] = field(default_factory=dict)
    continued: int = 0  # unfinished agents continuing from their last committed state
    retried: int = 0  # agents that had failed, starting over


def resume(initial: Sequence[AgentState], saved: Mapping[int, SavedAgent], *,
           retry_failed: bool) -> Resumed:
    """Each agent's state to run from: its saved one, or ``initial`` (new or retried)."""
    out = Resumed(states=[])
    for fresh in initial:
        got = saved.get(fresh.index)
        if got is None:
            out.states.append(fresh)
            continue
        status = got.state.status
        if status is AgentStatus.DONE or (status is AgentStatus.FAILED and not retry_failed):
            out.states.append(got.state)
            out.ended[fresh.index] = got.latency_s
        elif status.terminal:  # failed (or cancelled, which is never saved): run again
            out.states.append(fresh)
            out.retried += 1
        else:
            out.states.append(got.state)
            out.continued += 1
    return out
