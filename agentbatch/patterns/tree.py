"""aurora-swarm's ``tree_reduce``: a leaf level of agents, then supervisor levels of fan-in k.

It is ``run_with_reduce`` with ``reduce_fan_in=fan_in`` (``patterns/reduce.py`` holds the
levels, the prompt layout and the context check), shaped the way aurora-swarm users call it:
``items`` may be plain strings (each becomes ``{"item": s}`` for the leaf template), and the
supervisors reply with free text unless a ``reduce_schema`` is given. Both engines apply: every
level is a batch, distributed when ``redis_url`` is given (driven from this process).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel

from agentbatch.core.errors import BatchSpecError
from agentbatch.core.results import AgentResult
from agentbatch.patterns.reduce import Reduced, arun_with_reduce, run_with_reduce

LEAF_TASK = "{item}"
SUPERVISOR = ("You supervise {n} workers ({failed} of them failed). Combine their answers "
              "below into one answer.")


class Synthesis(BaseModel):
    """The supervisors' default reply: free text that can take its own outputs as input."""

    summary: str


def _args(items: Any, leaf_task: Any, fan_in: Any, reduce_schema: Any, kwargs: dict[str, Any]
          ) -> dict[str, Any]:
    if isinstance(items, str | bytes | Mapping) or not isinstance(items, Sequence):
        raise BatchSpecError(f"tree_reduce: items must be a list (of strings or dicts), got "
                             f"{type(items).__name__}")
    if not items:
        raise BatchSpecError("tree_reduce: items is empty: there is nothing to reduce")
    if isinstance(fan_in, bool) or not isinstance(fan_in, int) or fan_in < 2:
        raise BatchSpecError(f"tree_reduce: fan_in must be an int >= 2 (each supervisor "
                             f"combines that many answers), got {fan_in!r}")
    if "reduce_fan_in" in kwargs:
        raise BatchSpecError("tree_reduce: pass fan_in=, not reduce_fan_in=")
    inputs = [{"item": it} if isinstance(it, str) else it for it in items]
    return dict(task=leaf_task, inputs=inputs, reduce_fan_in=fan_in,
                        reduce_schema=reduce_schema or Synthesis, **kwargs)


def tree_reduce(
    items: Sequence[str | Mapping[str, Any]],
    *,
    leaf_task: str = LEAF_TASK,
    reduce: str = SUPERVISOR,
    fan_in: int = 4,
    reduce_schema: type[BaseModel] | None = None,
    **kwargs: Any,
) -> tuple[list[AgentResult], Reduced]:
    """Leaves, then supervisors over groups of ``fan_in`` until one answer remains.

    ``items``: strings (the leaf template's ``{item}``) or input dicts. ``leaf_task`` is
    rendered per item; ``reduce`` is the supervisors' template (``{n}``, ``{ok}``, ``{failed}``,
    ``{level}``), followed by the group's outputs and failures. ``reduce_schema`` (default
    ``Synthesis``: one ``summary`` string) is used at every supervisor level, so it must be
    able to take its own outputs. Every other keyword is ``run_with_reduce``'s / ``run_batch``'s
    (``backend`` may be a pool: a list of URLs or ``"@hostfile"``; ``redis_url``; ...).

    Returns ``(leaves, reduced)`` with ``run_with_reduce``'s contract: ``reduced`` is a
    ``reduce_schema`` instance, or the failed root supervisor's ``AgentResult``.
    """
    call = _args(items, leaf_task, fan_in, reduce_schema, kwargs)
    return run_with_reduce(reduce=reduce, **call)


async def atree_reduce(
    items: Sequence[str | Mapping[str, Any]],
    *,
    leaf_task: str = LEAF_TASK,
    reduce: str = SUPERVISOR,
    fan_in: int = 4,
    reduce_schema: type[BaseModel] | None = None,
    **kwargs: Any,
) -> tuple[list[AgentResult], Reduced]:
    """Async ``tree_reduce``."""
    call = _args(items, leaf_task, fan_in, reduce_schema, kwargs)
    return await arun_with_reduce(reduce=reduce, **call)
