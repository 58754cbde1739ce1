"""Tools and an output schema: agents call a tool, then answer in a Pydantic model.

A ``cacheable`` tool's identical calls within the batch run once: ten agents asking about
three cities make three lookups. Results stream as each agent finishes (``handle.results()``).
"""

from __future__ import annotations

import json

from _backend import MODEL, backend_url, sim_hint
from pydantic import BaseModel

from agentbatch import submit_batch, tool

_WEATHER = {"Paris": (18, "cloudy"), "Lima": (22, "sunny"), "Oslo": (4, "snow")}
lookups = 0


@tool(cacheable=True)
def weather(city: str) -> dict[str, object]:
    """Today's weather in a city.

    Args:
        city: the city's English name.
    """
    global lookups
    lookups += 1
    celsius, sky = _WEATHER.get(city, (15, "unknown"))
    return {"city": city, "celsius": celsius, "sky": sky}


class Advice(BaseModel):
    city: str
    take_umbrella: bool
    summary: str


def main() -> int:
    cities = [list(_WEATHER)[i % 3] for i in range(10)]
    task = "Should traveller #{n} going to {city} take an umbrella? Check the weather." + \
        sim_hint('tool weather {{"city": "{city}"}}')
    with backend_url() as backend:
        handle = submit_batch(task, [{"n": i, "city": c} for i, c in enumerate(cities)],
                              tools=[weather], output_schema=Advice, model=MODEL,
                              backend=backend, max_turns=4)
        with handle:
            results = list(handle.results())  # in completion order
    for r in sorted(results, key=lambda r: r.index):
        calls = [(c.name, json.dumps(c.arguments), c.cached or c.coalesced) for c in r.tool_calls]
        print(r.index, r.output if r.ok else r.error, calls)
    print(f"{sum(len(r.tool_calls) for r in results)} tool calls, {lookups} actual lookups")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
