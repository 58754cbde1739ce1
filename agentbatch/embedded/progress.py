"""An embedded batch's progress snapshot, read from its engine's in-memory agent states."""

from __future__ import annotations

import time

from agentbatch.core.agent_state import AgentState, AgentStatus
from agentbatch.core.pricing import cost_usd, state_cost
from agentbatch.embedded.engine import EmbeddedEngine
from agentbatch.turnloop.progress import (
    BatchProgress,
    Throughput,
    TokenCounts,
    eta,
    slowest,
)


def _spend(engine: EmbeddedEngine, states: list[AgentState]) -> float | None:
    """The batch's spend: each agent's ``state_cost`` (the one reckoning of ``cost_usd``,
    so the total is the sum of its results'), plus what provider batches billed for turns
    whose sync hedge had won (``ProviderBatchTurns.lost_usage``, at the batch prices: paid,
    and in no result's ``cost_usd``); None without prices for the model."""
    table, model = engine.rt.plan.prices, engine.rt.plan.model
    if not table or model not in table:
        return None
    lost = 0.0
    if engine.provider is not None:
        lost = cost_usd(engine.provider.lost_usage, table[model], batch=True)
    return sum(state_cost(s, table[model]) for s in states) + lost


def embedded_snapshot(engine: EmbeddedEngine | None, *, batch_id: str, total: int,
                      finished: bool, rate: Throughput) -> BatchProgress:
    """The snapshot of an embedded batch, from its engine's in-memory states: O(agents) in
    this process, no I/O. Read from any thread (copies taken under the GIL)."""
    now = time.monotonic()
    if engine is None:  # still preparing (preflight, prefix warm-up)
        return BatchProgress(batch_id=batch_id, engine="embedded", total=total, done=0,
                             failed=0, running=0, awaiting_tools=0, queued=total,
                             recovering=0, elapsed_s=0.0, finished=finished,
                             tokens=TokenCounts())
    states = list(engine.states.values())
    in_model, in_tools = engine.in_model.copy(), engine.in_tools.copy()
    done = awaiting = 0
    kinds: dict[str, int] = {}
    prompt = cached = completion = 0
    for s in states:
        prompt += s.usage.prompt_tokens
        cached += s.usage.cached_tokens
        completion += s.usage.completion_tokens
        if s.status is AgentStatus.DONE:
            done += 1
        elif s.terminal:
            kind = s.error.kind if s.error is not None else s.status.value
            kinds[kind] = kinds.get(kind, 0) + 1
        elif s.status is AgentStatus.AWAITING_TOOLS:
            awaiting += 1
    failed = sum(kinds.values())
    running = min(len(in_model), total - done - failed - awaiting)
    elapsed = now - engine.started_at
    throughput = rate.rate(done + failed, elapsed, now)
    return BatchProgress(
        batch_id=batch_id, engine="embedded", total=total, done=done, failed=failed,
        running=running, awaiting_tools=awaiting,
        queued=total - done - failed - awaiting - running, recovering=0, elapsed_s=elapsed,
        finished=finished, failed_by_kind=kinds,
        tokens=TokenCounts(prompt, cached, completion), throughput=throughput,
        cost_usd=_spend(engine, states),
        projected_cost_usd=None if engine.budget is None else engine.budget.projected_usd,
        budget_warning=None if engine.budget is None else engine.budget.warning,
        eta_s=eta(total - done - failed, throughput),
        slowest=slowest({**in_tools, **in_model}, now))
