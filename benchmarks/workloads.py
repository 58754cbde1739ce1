"""Workload definitions shared by every system under test (agentbatch and the peers).

A workload fixes what the simulator does (``fixed_ms`` per forward pass, unlimited
concurrency), what the tool does (``tool_ms`` of ``asyncio.sleep``), how many tool rounds each
agent makes, whether agents share tool keys, and the Pydantic schema of the final answer.

The task template makes the simulator's scripted model call the tool: one
``@sim tool lookup {"key": ...}`` line per round (see ``agentbatch.sim.script``). The JSON
braces are doubled because the template goes through ``str.format``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field

TOOL_NAME = "lookup"
TOOL_DESCRIPTION = "Look up the record stored under a key."
TOOL_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"key": {"type": "string", "description": "the record's key"}},
    "required": ["key"],
}
# One line per tool round; ``{field}`` is replaced by the input field holding that round's key.
TOOL_LINE = '@sim tool lookup {{"key": "{key}"}}'
SYSTEM_PROMPT = (
    "You are a careful records analyst. Look records up with the lookup tool, then report "
    "on them as JSON."
)
MODEL = "agentbatch-sim"


class LookupReport(BaseModel):
    """The final answer every agent must produce."""

    key: str
    value: str
    confidence: float = Field(ge=0.0, le=1.0)
    tags: list[str]


@dataclass(frozen=True)
class Workload:
    """One benchmark workload; every field is the same for agentbatch and the peers."""

    name: str
    """Name used on the command line and in result files."""
    agents: int
    """Default number of agents (N)."""
    fixed_ms: float
    """Simulator cost of one forward pass (``SimConfig(fixed_ms=...)``), unlimited concurrency."""
    tool_ms: float
    """Duration of one tool execution (an ``asyncio.sleep``)."""
    tool_rounds: int = 1
    """Tool calls per agent, one per model turn, before the final answer."""
    distinct_keys: int | None = None
    """How many different tool keys the batch uses; None: every agent its own keys."""
    cacheable: bool = False
    """Whether the tool is declared cacheable (results may be shared across agents)."""
    schema: type[BaseModel] = LookupReport
    """Pydantic model the final answer is validated against."""
    max_turns: int = 4
    """Turn budget given to every system (the workload needs ``tool_rounds + 1``)."""
    description: str = ""

    @property
    def model_turns_per_agent(self) -> int:
        return self.tool_rounds + 1

    @property
    def critical_path_s(self) -> float:
        """The physical bound on one agent's latency: forward passes plus tool waits."""
        return (self.model_turns_per_agent * self.fixed_ms + self.tool_rounds * self.tool_ms) / 1e3

    def expected_model_turns(self, agents: int | None = None) -> int:
        return (agents or self.agents) * self.model_turns_per_agent

    def expected_tool_executions(self, agents: int | None = None) -> int:
        """Executions needed with perfect sharing (distinct keys), or one per call."""
        n = agents or self.agents
        if self.distinct_keys is None:
            return n * self.tool_rounds
        return min(n, self.distinct_keys) * self.tool_rounds

    @property
    def task(self) -> str:
        """The ``str.format`` task template; renders to one ``@sim tool`` line per round."""
        lines = ["Report on record #{n} (key {key_0})."]
        lines += [TOOL_LINE.replace("{key}", f"{{key_{r}}}") for r in range(self.tool_rounds)]
        return "\n".join(lines)

    def key(self, agent: int, round_: int) -> str:
        slot = agent if self.distinct_keys is None else agent % self.distinct_keys
        return f"rec-{slot}-r{round_}"

    def inputs(self, agents: int | None = None) -> list[dict[str, Any]]:
        n = agents or self.agents
        return [
            {"n": i, **{f"key_{r}": self.key(i, r) for r in range(self.tool_rounds)}}
            for i in range(n)
        ]

    def describe(self) -> dict[str, Any]:
        """JSON-ready form for result files."""
        return {
            "name": self.name,
            "agents": self.agents,
            "fixed_ms": self.fixed_ms,
            "tool_ms": self.tool_ms,
            "tool_rounds": self.tool_rounds,
            "distinct_keys": self.distinct_keys,
            "cacheable": self.cacheable,
            "schema": self.schema.__name__,
            "max_turns": self.max_turns,
            "critical_path_s": self.critical_path_s,
            "description": self.description,
        }


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload(
            name="tool_roundtrip",
            agents=200,
            fixed_ms=60.0,
            tool_ms=200.0,
            description=(
                "BatchAgent README Table 1: 60 ms per forward pass, one 200 ms tool call per "
                "agent, Pydantic output. Every agent has its own key, so no coalescing or "
                "caching can help: this measures the engine."
            ),
        ),
        Workload(
            name="tool_roundtrip_shared",
            agents=200,
            fixed_ms=60.0,
            tool_ms=200.0,
            distinct_keys=10,
            cacheable=True,
            description=(
                "As tool_roundtrip, but only 10 distinct keys and a cacheable tool: shows how "
                "many tool executions each system actually performs."
            ),
        ),
    )
}


def get_workload(name: str) -> Workload:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise SystemExit(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}") from None


class ToolCounter:
    """Counts real executions of the tool body (shared or not, whatever the engine does)."""

    def __init__(self) -> None:
        self.executions = 0
        self.keys: set[str] = set()

    def reset(self) -> None:
        self.executions = 0
        self.keys.clear()


def make_lookup(workload: Workload, counter: ToolCounter):
    """The tool body every system runs: count, sleep ``tool_ms``, return a small record."""
    delay = workload.tool_ms / 1e3

    async def lookup(key: str) -> dict[str, Any]:
        """Look up the record stored under a key.

        Args:
            key: the record's key.
        """
        counter.executions += 1
        counter.keys.add(key)
        await asyncio.sleep(delay)
        return {"key": key, "value": f"value-of-{key}", "source": "benchmark"}

    lookup.__name__ = TOOL_NAME
    return lookup
