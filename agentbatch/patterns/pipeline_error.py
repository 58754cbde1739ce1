"""The error a multi-stage pattern raises when a stage cannot feed the next one."""

from __future__ import annotations

from agentbatch.core.errors import AgentBatchError
from agentbatch.core.results import AgentResult


class PipelineError(AgentBatchError):
    """A stage ended so that the next one cannot run (an empty plan, a failed planner, a
    reduce prompt larger than the reduce model's context). ``stage`` names it ("plan",
    "reduce"); ``results`` holds what the finished stages produced, so no work is lost:
    the planner's result for a plan stage, the map results for a reduce stage."""

    def __init__(self, message: str, *, stage: str, results: list[AgentResult]) -> None:
        super().__init__(f"{stage} stage: {message}")
        self.stage = stage
        self.results = results
