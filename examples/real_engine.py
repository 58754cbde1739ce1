"""A real model: llama.cpp's ``llama-server`` with SmolLM2-135M (CPU is enough).

    agentbatch engine install           # once: builds llama-server, fetches the model
    python examples/real_engine.py      # starts llama-server here, runs, stops it

or point it at a server you run: ``AGENTBATCH_BACKEND=llamacpp://host:8080``
(and ``AGENTBATCH_MODEL``). The output schema is enforced by the server's grammar, so even a
135M model returns valid JSON; what it says is another matter at that size.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

from pydantic import BaseModel, Field

from agentbatch import run_batch

REVIEWS = ["Great kettle, boils fast and looks nice.", "Broke after two days, very sad.",
           "Does the job, the lid is a bit loose.", "Terrible support, never again.",
           "Lovely colour and the cable is long enough."]


class Verdict(BaseModel):
    label: Literal["positive", "negative"]
    reason: str = Field(max_length=40)


@contextmanager
def engine() -> Iterator[tuple[str, str]]:
    """(backend URL, model): yours from the environment, or a llama-server started here."""
    if os.environ.get("AGENTBATCH_BACKEND"):
        yield os.environ["AGENTBATCH_BACKEND"], os.environ.get("AGENTBATCH_MODEL", "smollm2")
        return
    from agentbatch.engine import INSTALL_COMMAND, LlamaServer, installed

    if installed() is None:
        raise SystemExit(f"the engine is not installed: run `{INSTALL_COMMAND}` first")
    with LlamaServer(parallel=2) as server:
        yield server.backend, server.model


def main() -> int:
    with engine() as (backend, model):
        results = run_batch(
            "Review {i}: {text}", [{"i": i, "text": t} for i, t in enumerate(REVIEWS)],
            system_prompt="You label short product reviews: positive or negative, with a "
                          "very short reason.",
            output_schema=Verdict, model=model, backend=backend,
            max_tokens=64, temperature=0.0, timeout_per_turn=300,
        )
    for r in results:
        print(r.index, r.output if r.ok else r.error)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
