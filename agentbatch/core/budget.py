"""Spend caps and the cost projection of an embedded batch (``max_cost_usd``,
``max_agent_cost_usd``): pure bookkeeping, fed every committed agent state.

A cap is checked when a turn is about to be sent (after its inference slot is taken), so at a
cap no new turn starts while turns already sent finish and are paid for: a batch's spend
stays within the cap plus the turns in flight when it was reached.

The remaining work is estimated (``WorkEstimate``) as the turns an agent takes on average:
the mean reply count of the agents that finished ok so far, or ``max_turns`` before any has
(the conservative bound); an unfinished agent is counted for at least one more turn. The
projection is the spend so far plus the mean cost of a reply so far times those turns.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from agentbatch.core.agent_state import AgentState, AgentStatus
from agentbatch.core.plan import BatchPlan
from agentbatch.core.pricing import agent_cost, state_cost

log = logging.getLogger(__name__)


@dataclass
class WorkEstimate:
    """Turns left in a batch, kept in O(1) per committed state (no scan of the agents)."""

    total: int
    max_turns: int
    live: int = field(init=False)
    live_turns: int = 0  # replies so far of the agents still running
    done: int = 0
    done_turns: int = 0  # replies of the agents that finished ok

    def __post_init__(self) -> None:
        self.live = self.total

    def record(self, before: AgentState, after: AgentState) -> None:
        if before.terminal:
            return
        if after.terminal:
            self.live -= 1
            self.live_turns -= before.turns
            if after.status is AgentStatus.DONE:
                self.done += 1
                self.done_turns += after.turns
        else:
            self.live_turns += after.turns - before.turns

    @property
    def turns_per_agent(self) -> float:
        """The mean replies of an agent that finished ok; ``max_turns`` before any has."""
        return self.done_turns / self.done if self.done else float(self.max_turns)

    def turns_left(self, state: AgentState) -> float:
        """The estimated turns ``state`` still needs, this one included (>= 1)."""
        return max(self.turns_per_agent - state.turns, 1.0)

    @property
    def remaining_turns(self) -> float:
        return max(self.live * self.turns_per_agent - self.live_turns, float(self.live))


def cap_refusal(max_cost_usd: float | None, spent: float, max_agent_cost_usd: float | None,
                mine: float) -> str | None:
    """Why a turn may not start with the batch at ``spent`` and its agent at ``mine`` (a cap
    reached), or None: one wording for both engines."""
    if max_cost_usd is not None and spent >= max_cost_usd:
        return (f"max_cost_usd={max_cost_usd:g} reached: the batch has spent "
                f"${spent:.6f}, so no new turn was started")
    if max_agent_cost_usd is not None and mine >= max_agent_cost_usd:
        return (f"max_agent_cost_usd={max_agent_cost_usd:g} reached: this agent has "
                f"spent ${mine:.6f}, so no new turn was started")
    return None


def plan_refusal(plan: BatchPlan, state: AgentState, spent: float) -> str | None:
    """``cap_refusal`` for a distributed turn: the batch's spend as the claim read it from
    Redis (fleet-wide), the agent's own from the usage in its state."""
    if plan.max_cost_usd is None and plan.max_agent_cost_usd is None:
        return None
    mine = agent_cost(state, plan.prices, plan.model) or 0.0
    return cap_refusal(plan.max_cost_usd, spent, plan.max_agent_cost_usd, mine)


def turn_spend(plan: BatchPlan, old: AgentState, new: AgentState) -> float | None:
    """What ``old`` → ``new`` adds to the batch's spend at its prices (None: no prices)."""
    if not plan.prices:
        return None
    if (new.usage == old.usage and new.batch_usage == old.batch_usage
            and new.hedge_usage == old.hedge_usage):
        return 0.0
    after = agent_cost(new, plan.prices, plan.model) or 0.0
    before = agent_cost(old, plan.prices, plan.model) or 0.0
    return after - before


class Budget:
    """The caps of one batch, its spend so far and the projection to its end."""

    def __init__(self, prices: Mapping[str, float] | None, work: WorkEstimate, *,
                 max_cost_usd: float | None = None,
                 max_agent_cost_usd: float | None = None) -> None:
        self.prices = prices
        self.work = work
        self.max_cost_usd = max_cost_usd
        self.max_agent_cost_usd = max_agent_cost_usd
        self.spent = 0.0
        self.replies = 0  # priced model replies so far
        self._agent: dict[int, float] = {}
        self.warning: str | None = None  # set once the projection passes max_cost_usd

    def cost(self, state: AgentState) -> float:
        if self.prices is None:
            return 0.0
        return state_cost(state, self.prices)

    def record(self, before: AgentState, after: AgentState) -> None:
        """Account one committed transition (called for every state the engine commits)."""
        if (before.status is after.status and before.turns == after.turns
                and (self.prices is None or (after.usage == before.usage
                                             and after.hedge_usage == before.hedge_usage))):
            # Nothing to account: the same status and replies move no estimate, the same
            # usage no spend. A turn's tool results take this way, one of its two commits
            # (issue 26 item 5).
            return
        self.work.record(before, after)
        if self.prices is None or (after.usage == before.usage
                                   and after.hedge_usage == before.hedge_usage):
            return
        now = self.cost(after)
        self.spent += now - self._agent.get(after.index, 0.0)
        self._agent[after.index] = now
        self.replies += after.turns - before.turns
        self._check_projection()

    def refusal(self, state: AgentState) -> str | None:
        """Why ``state`` may not start a new turn (a cap reached), or None."""
        return cap_refusal(self.max_cost_usd, self.spent, self.max_agent_cost_usd,
                           self._agent.get(state.index, 0.0))

    @property
    def projected_usd(self) -> float | None:
        """Spend at the end at the mean cost per reply so far; None before any reply."""
        if self.prices is None or not self.replies:
            return None
        return self.spent + self.spent / self.replies * self.work.remaining_turns

    def _check_projection(self) -> None:
        if self.warning is not None or self.max_cost_usd is None:
            return
        projected = self.projected_usd
        if projected is not None and math.isfinite(projected) and projected > self.max_cost_usd:
            self.warning = (f"projected cost ${projected:.4f} passes max_cost_usd="
                            f"{self.max_cost_usd:g} (spent ${self.spent:.4f} over "
                            f"{self.replies} replies, ~{self.work.remaining_turns:.0f} turns "
                            "left): the cap will end agents budget_exceeded")
            log.warning("batch on course to pass its cap: %s", self.warning)
