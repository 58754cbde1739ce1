"""The chaos harness's submitting and collecting processes.

``submit`` submits a batch, records its id, then logs every result it reads until it is
killed. ``collect`` re-attaches with ``get_batch`` and writes every result it can read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from agentbatch import get_batch, submit_batch
from tests.support.tools import ChaosAnswer, cached_lookup, lookup

TASK = (
    "Agent {i}.\n"
    '@sim tool lookup {{"key": "u{i}"}}\n'
    '@sim tool cached_lookup {{"key": "c{c}"}}\n'
    "{round3}\n"
    "{fault}"
)
ROUND3 = '@sim tool lookup {"key": "s%d"}'
# Every DUP_IDS_EVERY-th agent's third round is two calls that share one id (a server's
# buggy tool parser): both must run, each result must reach its own call, the agent ends ok.
DUP_IDS_EVERY = 89
DUP_IDS = '@sim same_ids\n@sim tools lookup {"key": "s%d"}; lookup {"key": "d%d"}'
# Every STEP_BUG_EVERY-th agent answers with a value whose validator raises KeyError inside
# the state machine's step(): it must end with kind "internal", never loop.
STEP_BUG_EVERY = 97
STEP_BUG = '@sim answer {"summary": "boom", "score": 1}'


def _dup_ids(i: int) -> bool:
    return i % DUP_IDS_EVERY == DUP_IDS_EVERY - 1


def inputs(n: int, faults: bool = True) -> list[dict[str, object]]:
    """The chaos batch's inputs; ``faults=False`` leaves out the model faults (duplicate ids,
    step bugs) for runs that measure speed, not liveness."""
    return [{"i": i, "c": i % 20,
             "round3": DUP_IDS % (i % 50, i) if faults and _dup_ids(i) else ROUND3 % (i % 50),
             "fault": STEP_BUG if faults and i % STEP_BUG_EVERY == STEP_BUG_EVERY - 1 else ""}
            for i in range(n)]


def dup_id_agents(n: int) -> list[int]:
    return [i for i in range(n) if _dup_ids(i)]


def step_bug_agents(n: int) -> int:
    return sum(1 for i in range(n) if i % STEP_BUG_EVERY == STEP_BUG_EVERY - 1)


def submit(args: argparse.Namespace) -> None:
    handle = submit_batch(TASK, inputs(args.agents), tools=[lookup, cached_lookup],
                          output_schema=ChaosAnswer, model="sim-model", backend=args.backend,
                          redis_url=args.redis_url, max_turns=5, max_retries=4,
                          timeout_per_turn=args.timeout_per_turn)
    out = Path(args.out)
    tmp = out.with_suffix(".id.tmp")
    tmp.write_text(handle.batch_id)
    tmp.rename(out.with_suffix(".id"))  # atomic: the harness never reads a half-written id
    with out.open("w") as f:
        for result in handle.results():
            f.write(f"{result.index}\n")
            f.flush()


def collect(args: argparse.Namespace) -> None:
    handle = get_batch(args.batch_id, redis_url=args.redis_url)
    rows = []
    try:
        for r in handle.results(timeout=args.timeout):
            rows.append({"index": r.index, "ok": r.ok, "latency_s": r.latency_s,
                         "error": r.error.model_dump() if r.error else None})
    except Exception as exc:  # the harness reports how the reader ended
        Path(args.out).write_text(json.dumps({"rows": rows, "raised": repr(exc)}))
        sys.exit(3)
    Path(args.out).write_text(json.dumps({"rows": rows, "raised": None}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["submit", "collect"])
    p.add_argument("--redis-url", required=True)
    p.add_argument("--backend", default="")
    p.add_argument("--agents", type=int, default=1000)
    p.add_argument("--batch-id", default="")
    p.add_argument("--out", required=True)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--timeout-per-turn", type=float, default=5.0)
    args = p.parse_args()
    submit(args) if args.mode == "submit" else collect(args)


if __name__ == "__main__":
    main()
