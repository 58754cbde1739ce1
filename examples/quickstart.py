"""Quickstart: one task template, many inputs, one validated result per input.

    python examples/quickstart.py          # against a simulator started here
    AGENTBATCH_BACKEND=vllm://gpu-0:8000 AGENTBATCH_MODEL=Qwen/Qwen2.5-7B-Instruct \\
        python examples/quickstart.py      # against your server
"""

from __future__ import annotations

from _backend import MODEL, backend_url
from pydantic import BaseModel

from agentbatch import run_batch


class Sentiment(BaseModel):
    label: str
    confidence: float


REVIEWS = ["Loved it, would buy again.", "Broke after two days.", "It is fine, I guess.",
           "Best purchase this year!", "The box was damaged but the item works."]


def main() -> int:
    with backend_url() as backend:
        results = run_batch(
            "Classify the sentiment of this review as positive, negative or neutral:\n{review}",
            [{"review": r} for r in REVIEWS],
            output_schema=Sentiment, model=MODEL, backend=backend, max_turns=2,
        )
    for r in results:  # input order; a failure is data, not an exception
        print(r.index, r.input["review"][:30], "->", r.output if r.ok else r.error)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
