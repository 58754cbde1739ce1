"""An embedded batch's progress snapshot, read from its engine's in-memory agent states."""

from __future__ import annotations

import time

from agentbatch.core.agent_state import AgentStatus
from agentbatch.core.model_io import Usage
from agentbatch.core.pricing import plan_cost
from agentbatch.embedded.engine import EmbeddedEngine
from agentbatch.turnloop.progress import (
    BatchProgress,
    Throughput,
    TokenCounts,
    eta,
    slowest,
)


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
    batch_usage = hedge_usage = Usage()
    for s in states:
        if s.batch_turns:
            batch_usage = batch_usage + s.batch_usage
        if s.hedge_usage is not None:
            hedge_usage = hedge_usage + s.hedge_usage
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
        cost_usd=plan_cost(Usage(prompt_tokens=prompt, cached_tokens=cached,
                                 completion_tokens=completion),
                           engine.rt.plan.prices, engine.rt.plan.model, batch_usage,
                           hedge_usage),
        projected_cost_usd=None if engine.budget is None else engine.budget.projected_usd,
        budget_warning=None if engine.budget is None else engine.budget.warning,
        eta_s=eta(total - done - failed, throughput),
        slowest=slowest({**in_tools, **in_model}, now))
