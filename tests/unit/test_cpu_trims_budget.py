"""``Budget.record``'s early return (issue 26 item 5) for a commit that moves nothing: on
random walks of committed states, with and without prices and caps, it keeps exactly the
books the full accounting kept."""

from __future__ import annotations

import random

import pytest

from agentbatch.core.agent_state import AgentState, AgentStatus
from agentbatch.core.budget import Budget, WorkEstimate
from agentbatch.core.model_io import Usage


class FullBudget(Budget):
    """``Budget.record`` as it was: every commit through the whole accounting."""

    def record(self, before: AgentState, after: AgentState) -> None:
        self.work.record(before, after)
        if self.prices is None or (after.usage == before.usage
                                   and after.hedge_usage == before.hedge_usage):
            return
        now = self.cost(after)
        self.spent += now - self._agent.get(after.index, 0.0)
        self._agent[after.index] = now
        self.replies += after.turns - before.turns
        self._check_projection()


def _books(b: Budget) -> tuple[object, ...]:
    w = b.work
    return (b.spent, b.replies, dict(b._agent), b.warning, b.projected_usd,
            w.live, w.live_turns, w.done, w.done_turns, w.remaining_turns)


def _step(rng: random.Random, s: AgentState) -> AgentState:
    """A next committed state: a reply, tool results, an end, a hedge's loss, a no-op..."""
    kind = rng.randrange(7)
    u = s.usage
    if kind == 0:  # a reply
        return s.model_copy(update={
            "turns": s.turns + 1, "status": AgentStatus.AWAITING_TOOLS,
            "usage": Usage(prompt_tokens=u.prompt_tokens + rng.randrange(1, 500),
                           completion_tokens=u.completion_tokens + rng.randrange(0, 50))})
    if kind == 1:  # tool results: back to the model, nothing paid
        return s.model_copy(update={"status": AgentStatus.NEEDS_MODEL})
    if kind == 2:  # the same status, nothing paid (a retry, a checkpoint)
        return s.model_copy(update={"retries": s.retries + 1})
    if kind == 3:  # an end
        status = rng.choice([AgentStatus.DONE, AgentStatus.FAILED, AgentStatus.CANCELLED])
        return s.model_copy(update={"status": status, "turns": s.turns + rng.randrange(2)})
    if kind == 4:  # a hedge lost: paid, no reply, same status
        h = s.hedge_usage or Usage()
        return s.model_copy(update={"hedge_usage": Usage(
            prompt_tokens=h.prompt_tokens + rng.randrange(1, 300))})
    if kind == 5:  # usage changed without a reply (a summary's tokens), same status
        return s.model_copy(update={"usage": Usage(
            prompt_tokens=u.prompt_tokens + rng.randrange(1, 100),
            completion_tokens=u.completion_tokens)})
    return s.model_copy(update={"turns": s.turns + 1})  # a reply with no tokens reported


@pytest.mark.parametrize("prices", [None, {"prompt": 1e-6, "completion": 4e-6}])
@pytest.mark.parametrize("cap", [None, 1e-3])
@pytest.mark.parametrize("seed", range(6))
def test_the_books_are_those_of_the_full_accounting(
        prices: dict[str, float] | None, cap: float | None, seed: int) -> None:
    rng = random.Random(seed)
    agents = 12
    fast = Budget(prices, WorkEstimate(total=agents, max_turns=8), max_cost_usd=cap,
                  max_agent_cost_usd=cap)
    full = FullBudget(prices, WorkEstimate(total=agents, max_turns=8), max_cost_usd=cap,
                      max_agent_cost_usd=cap)
    states = [AgentState(index=i, input={"i": i}) for i in range(agents)]
    for _ in range(600):
        i = rng.randrange(agents)
        before = states[i]
        after = _step(rng, before)
        fast.record(before, after)
        full.record(before, after)
        assert _books(fast) == _books(full)
        assert fast.refusal(after) == full.refusal(after)
        states[i] = after
