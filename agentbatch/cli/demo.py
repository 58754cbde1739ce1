"""`agentbatch demo`: a 100-agent batch with a tool and a schema, against a local simulator."""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel

from agentbatch.toolpool import tool

COUNTRIES = ["France", "Japan", "Brazil", "Kenya", "Canada", "India", "Norway", "Chile",
             "Egypt", "Vietnam"]
_FACTS = {c: {"capital": cap, "population_m": pop} for c, cap, pop in [
    ("France", "Paris", 68), ("Japan", "Tokyo", 124), ("Brazil", "Brasília", 216),
    ("Kenya", "Nairobi", 55), ("Canada", "Ottawa", 40), ("India", "New Delhi", 1428),
    ("Norway", "Oslo", 5), ("Chile", "Santiago", 19), ("Egypt", "Cairo", 112),
    ("Vietnam", "Hanoi", 99)]}


class CountryBrief(BaseModel):
    """What each agent must return."""

    country: str
    capital: str
    summary: str
    risk_score: int


@tool(cacheable=True)
async def country_facts(country: str) -> dict[str, Any]:
    """Look up basic facts about a country.

    Args:
        country: the country's English name.
    """
    import asyncio

    await asyncio.sleep(0.2)  # a slow external lookup
    return {"country": country, **_FACTS.get(country, {})}


TASK = (
    "Write a short brief about {country} for analyst #{n}.\n"
    '@sim tool country_facts {{"country": "{country}"}}'
)


def run_demo(agents: int = 100, fixed_ms: float = 60.0,
             fault_rates: dict[str, float] | None = None) -> dict[str, Any]:
    """Start a simulator process (injecting ``fault_rates``, ``sim.faults``), run the batch
    on the embedded engine, return a report. Failed agents are in it (``ok``, ``errors``):
    they are the demo's data, not its failure."""
    from agentbatch import run_batch
    from agentbatch.sim.config import SimConfig
    from agentbatch.sim.process import SimProcess

    inputs = [{"country": COUNTRIES[i % len(COUNTRIES)], "n": i} for i in range(agents)]
    with SimProcess(SimConfig(fixed_ms=fixed_ms, fault_rates=dict(fault_rates or {}))) as sim:
        started = time.perf_counter()
        results = run_batch(
            TASK, inputs,
            system_prompt="You are a concise geopolitical analyst.",
            tools=[country_facts],
            output_schema=CountryBrief,
            model="agentbatch-sim",
            backend=f"sim://{sim.url.split('://', 1)[1]}",
            max_turns=4,
        )
        wall = time.perf_counter() - started
    calls = sum(len(r.tool_calls) for r in results)
    shared = sum(1 for r in results for c in r.tool_calls if c.cached or c.coalesced)
    return {
        "agents": agents,
        "ok": sum(r.ok for r in results),
        "wall_s": wall,
        "critical_path_s": (2 * fixed_ms + 200) / 1000,
        "turns": sum(r.turns for r in results),
        "tool_calls": calls,
        "tool_calls_shared": shared,
        "prompt_tokens": sum(r.usage.prompt_tokens for r in results),
        "cached_tokens": sum(r.usage.cached_tokens for r in results),
        "first": results[0].output.model_dump() if results and results[0].ok else None,
        "errors": [r.error.model_dump() for r in results if not r.ok and r.error][:3],
    }
