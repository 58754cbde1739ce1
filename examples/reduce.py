"""Map, then reduce: every result of a batch goes to one reduce agent (or a tree of them).

The reduce prompt holds every map output (as JSON, in input order) and every map failure;
``{n}``, ``{ok}`` and ``{failed}`` are filled in the template. ``reduce_fan_in=k`` reduces in
groups of k, level by level, for map stages too large for one prompt.
"""

from __future__ import annotations

from _backend import MODEL, backend_url
from pydantic import BaseModel

from agentbatch import run_with_reduce


class Claims(BaseModel):
    claims: list[str]


class RankedClaims(BaseModel):
    ranked: list[str]
    rationale: str


TEXTS = ["Coffee improves focus.", "Coffee disrupts sleep.", "Tea has less caffeine.",
         "Decaf still has some caffeine.", "Caffeine is a stimulant.", "Water is best."]


def main() -> int:
    with backend_url() as backend:
        results, ranked = run_with_reduce(
            "Extract the factual claims from: {text}",
            [{"text": t} for t in TEXTS],
            output_schema=Claims,
            reduce="You received {n} claim lists ({failed} failed). Deduplicate them and "
                   "rank the claims by evidence.",
            reduce_schema=RankedClaims,
            reduce_fan_in=3,  # two groups of three, then one final reduce
            model=MODEL, backend=backend, max_turns=2,
        )
    print(f"map: {sum(r.ok for r in results)}/{len(results)} ok")
    print("reduced:", ranked)
    return 0 if isinstance(ranked, RankedClaims) else 1


if __name__ == "__main__":
    raise SystemExit(main())
