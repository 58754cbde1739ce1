"""The compiled, JSON-serializable description of a batch.

A plan is everything a worker on another machine needs to run any agent of the batch: the
shared prefix, tool and schema import paths, limits. It is written once per batch.
"""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Any, Literal

from pydantic import BaseModel, Field

from agentbatch.core.options import BatchOptions, Compaction, PoolRouting, Pricing, ToolChoice

_DEFAULTS = {f.name: f.default for f in fields(BatchOptions) if f.default is not MISSING}


def _default(option: str) -> Any:
    """The default ``BatchOptions`` declares for ``option``."""
    return _DEFAULTS[option]


class ToolRef(BaseModel):
    """A tool by name plus where a worker can import it from (None: in-process only)."""

    name: str
    import_path: str | None = None


class BatchPlan(BaseModel):
    """Per-batch constants. ``system_message`` + ``tool_schemas`` form the shared prefix."""

    batch_id: str
    total: int
    model: str
    backends: list[str]
    system_message: str
    tool_refs: list[ToolRef] = Field(default_factory=list)
    tool_schemas: list[dict[str, Any]] = Field(default_factory=list)
    output_schema_path: str | None = None
    output_schema_name: str | None = None
    output_json_schema: dict[str, Any] | None = None
    # The options a worker needs: names and types as ``BatchOptions`` declares them (the
    # docs are there), defaults taken from it (a plan written before an option existed
    # reads as its default). ``compile_batch`` copies them all (``option_values``).
    max_turns: int = _default("max_turns")
    max_retries: int = _default("max_retries")
    max_inflight: int | None = _default("max_inflight")
    timeout_per_turn: float | None = _default("timeout_per_turn")
    timeout_per_tool: float | None = _default("timeout_per_tool")
    max_tokens: int | None = _default("max_tokens")
    temperature: float | None = _default("temperature")
    native_json_schema: bool = _default("native_json_schema")
    warm_prefix: bool = _default("warm_prefix")
    batch_prompting: bool = _default("batch_prompting")
    max_server_waiting: int | None = _default("max_server_waiting")
    max_tool_calls_per_turn: int = _default("max_tool_calls_per_turn")
    max_tool_output_chars: int = _default("max_tool_output_chars")
    max_context_tokens: int | None = _default("max_context_tokens")
    compaction: Compaction | None = _default("compaction")
    compaction_threshold: float = _default("compaction_threshold")
    # the batch model's entry of ``prices``, read and checked at submit (``pricing.py``)
    prices: dict[str, dict[str, float]] | None = _default("prices")
    # the caps a worker checks as it claims a turn, against the batch's spend kept in Redis
    # by the commit script (``lua/commit.lua``) and the agent's own usage
    max_cost_usd: float | None = _default("max_cost_usd")
    max_agent_cost_usd: float | None = _default("max_agent_cost_usd")
    # each worker hedges the turns it runs on the pool (``workers/hedging.py``)
    hedge_after: float | None = _default("hedge_after")
    # how each process's pool routes a turn (``backends/pool.py``)
    pool_routing: PoolRouting = _default("pool_routing")
    pool_load_factor: float = _default("pool_load_factor")
    # "batch"/"auto": the workers send model turns through the provider's batch API
    # (distributed/provider_batches.py), "auto" routing each (turnloop/batch_routing.py)
    pricing: Pricing = _default("pricing")
    # ``deadline`` as an absolute time in Redis's clock (epoch seconds; the submitter and
    # the workers sync to it), set at submit: "seconds from submit" means one instant fleet-wide
    deadline_at: float | None = None
    # set at submit: the llama.cpp endpoints (name -> slots) whose warm-up probe found that
    # pinning turns to slots keeps the prefix; the workers pin theirs through the fleet's
    # slot map (``distributed/state/slot_map.py``), as the embedded engine's ``SlotPicker``
    pinned_slots: dict[str, int] = Field(default_factory=dict)
    # resolved from "auto" at submit (``json_tool_calling.mode_for_backends``)
    tool_calling: Literal["native", "json"] = "native"
    tool_choice: ToolChoice = _default("tool_choice")
    required_tool_rounds: int = _default("required_tool_rounds")
    keep_transcript: bool = _default("keep_transcript")
    created_at: float = 0.0
    # a stage of a chained pipeline (patterns/pipeline_chain.py): the commit that finishes
    # this batch enqueues the task that submits the next stage
    pipeline_id: str | None = None
    pipeline_stage: int = 0

    @staticmethod
    def option_values(opts: BatchOptions) -> dict[str, Any]:
        """The values of ``opts`` for every option the plan carries."""
        return {name: getattr(opts, name) for name in carried_options()}

    @property
    def has_tools(self) -> bool:
        return bool(self.tool_schemas)


def carried_options() -> list[str]:
    """The ``BatchOptions`` fields the plan copies as given (``batch_id`` and ``model`` it
    sets itself: a random id when None, the model the environment resolved)."""
    return [name for name in BatchPlan.model_fields
            if name in _DEFAULTS and name not in ("batch_id", "model")]
