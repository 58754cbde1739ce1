"""The review-labelling workload the engine tests share (workers import ``Verdict`` from here
through ``AGENTBATCH_WORKER_IMPORTS=...,tests.engine``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, Field

TASK = "Review {i}: {text}"
REVIEWS = [
    "Great kettle, boils fast and looks nice.",
    "Broke after two days, very disappointed.",
    "Does the job, the lid is a bit loose.",
    "Terrible support, never buying again.",
    "Lovely colour and the cable is long enough.",
]


class Verdict(BaseModel):
    label: Literal["positive", "negative"]
    reason: str = Field(max_length=40)


def inputs(n: int, reviews: Sequence[str] = REVIEWS) -> list[dict[str, object]]:
    return [{"i": i, "text": reviews[i % len(reviews)]} for i in range(n)]
