"""Checkpoint and resume: a batch stopped half-way picks up where it stopped.

With ``checkpoint_dir=``, every committed turn of every agent is saved in a SQLite file. Run
the same batch again after a crash (here: a cancel half-way) and the agents that finished come
back from the checkpoint without a model call; the others continue from their last turn.
See docs/checkpoints.md.
"""

from __future__ import annotations

import tempfile

from _backend import MODEL, backend_url, sim_hint
from pydantic import BaseModel

from agentbatch import submit_batch, tool


@tool
def word_count(text: str) -> int:
    """Count the words of a text.

    Args:
        text: the text.
    """
    return len(text.split())


class Count(BaseModel):
    words: int


LINES = ["the cat sat", "on the mat", "and then it slept", "all day long", "in the sun",
         "until dinner time"]


def main() -> int:
    task = "How many words are in: {line!r}? Use the tool." + \
        sim_hint('tool word_count {{"text": "{line}"}}') + \
        sim_hint('answer {{"words": {words}}}')
    inputs = [{"line": line, "words": len(line.split())} for line in LINES]
    options = {"tools": [word_count], "output_schema": Count, "model": MODEL, "max_turns": 4,
               "max_inflight": 2}  # a few at a time, so the stop catches some mid-way
    with tempfile.TemporaryDirectory() as where, backend_url() as backend:
        finished = 0
        with submit_batch(task, inputs, backend=backend, checkpoint_dir=where,
                          **options) as handle:  # type: ignore[arg-type]
            for result in handle.results():
                finished += result.ok
                if finished == 2:
                    handle.cancel()  # stands for a crash: the other agents stop mid-way
        with submit_batch(task, inputs, backend=backend, checkpoint_dir=where,
                          **options) as again:  # type: ignore[arg-type]
            results = again.wait()
            sent = again.stats()["requests_sent"]
    for r in results:
        print(r.index, repr(LINES[r.index]), "->", r.output if r.ok else r.error)
    print(f"first run: {finished} of {len(inputs)} finished before the stop; the re-run sent "
          f"{sent} model requests, not {2 * len(inputs)}")
    print(f"after resume: {sum(r.ok for r in results)}/{len(results)} ok")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
