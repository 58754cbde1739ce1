"""Plan -> map -> reduce: a planner lists the work, one agent per item does it, one reduces.

The plan schema needs an ``items: list[str]`` field (or name another with ``plan_items=``);
``task`` is formatted with ``{item}``, and each map result's ``input`` holds its plan item.
Each stage may use its own model (``planner_model=``, ``worker_model=``, ``reducer_model=``).
"""

from __future__ import annotations

from _backend import MODEL, backend_url
from pydantic import BaseModel

from agentbatch import run_with_map_reduce


class Plan(BaseModel):
    items: list[str]


class Answer(BaseModel):
    answer: str


class Survey(BaseModel):
    title: str
    body: str


def main() -> int:
    with backend_url() as backend:
        answers, survey = run_with_map_reduce(
            "List five research questions about: {topic}",
            {"topic": "prefix caching for many agents"},
            Plan,
            "Answer this research question in two sentences: {item}",
            Answer,
            "Synthesize the {ok} answers into a short survey.",
            Survey,
            model=MODEL, backend=backend, max_turns=2,
        )
    for r in answers:
        print(r.input["item"], "->", r.output if r.ok else r.error)
    print("survey:", survey)
    return 0 if isinstance(survey, Survey) else 1


if __name__ == "__main__":
    raise SystemExit(main())
