"""The clairvoyant lower bound of ``bench_cost``: the cheapest any routing policy could be at a
deadline if it knew every turn's provider batch latency in advance.

Inputs come from the all-batch pass of the same run. Per agent and turn, the simulator's
ground truth (``/sim/batch_jobs``): the turn's tokens and its provider batch's latency, from
the batch's creation to when its last request finished -- uncut by a hedge the sync API won
or by the cancel that followed, so not censored. What else an agent's finish held (the
submit window, polls, commits, tools) is its overhead: its measured finish less the sum of its
turns' batch latencies, split evenly over its turns; an agent a hedge cut short (it moved on
before a batch's end) takes the median per-turn overhead of the others.

Per agent, every subset of its turns is tried on the sync API (each at ``sync_turn_s``, in
place of that turn's batch latency and overhead): the cheapest subset that finishes by the
deadline wins; an agent no subset gets there in goes all-sync and counts as late. Assumes a
turn's batch latency does not depend on routing (the batch it was in keeps its composition
and latency when one of its turns goes sync) and no hedges (nothing paid twice).
"""

from __future__ import annotations

import itertools
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agentbatch.core.model_io import Usage
from agentbatch.core.pricing import cost_usd

# a turn's custom_id ends with its agent's index and version: t{n}-{batch id}-{index}-v{version}
# on the embedded engine, ab-{tag}-{index}-{version} on the distributed one
CUSTOM_ID = re.compile(r"-(?P<index>\d+)-v?\d+$")


@dataclass(frozen=True)
class Turn:
    """One turn of the all-batch pass: its provider batch's latency and its tokens."""

    batch_s: float  # the batch's creation to its last request's finish (ground truth)
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class AgentTurns:
    """An agent's turns in order, and its per-turn overhead (seconds not in a provider batch)."""

    turns: tuple[Turn, ...]
    overhead_s: float | None  # None: a hedge cut it short; the median is used


@dataclass(frozen=True)
class Choice:
    """The routing picked for one agent: which turns go sync, at what cost and finish."""

    sync: tuple[bool, ...]
    cost_usd: float
    finish_s: float
    late: bool  # no routing of its turns finishes by the deadline


def cheapest_routing(batch_s: Sequence[float], sync_s: Sequence[float],
                     batch_usd: Sequence[float], sync_usd: Sequence[float],
                     deadline_s: float) -> Choice:
    """The cheapest choice of turns to send to the sync API so that the agent's finish (the
    sum of each turn's time on its API) is within ``deadline_s``; ties go to the earlier
    finish. When none is, the fastest (all-sync if sync is faster everywhere), marked late.
    Exhaustive: an agent has a handful of turns."""
    n = len(batch_s)
    best: Choice | None = None
    fastest: Choice | None = None
    for sync in itertools.product((False, True), repeat=n):
        finish = sum(sync_s[k] if sync[k] else batch_s[k] for k in range(n))
        cost = sum(sync_usd[k] if sync[k] else batch_usd[k] for k in range(n))
        choice = Choice(sync, cost, finish, late=finish > deadline_s)
        if not choice.late and (best is None or (cost, finish) < (best.cost_usd, best.finish_s)):
            best = choice
        if fastest is None or (finish, cost) < (fastest.finish_s, fastest.cost_usd):
            fastest = choice
    assert fastest is not None
    return best if best is not None else fastest


def agent_turns(jobs: Iterable[Mapping[str, Any]], finished: Mapping[int, float],
                started: float) -> dict[int, AgentTurns]:
    """Per agent index, its turns from the simulator's timelines (``/sim/batch_jobs`` of the
    all-batch pass: ``started`` is its submit and ``finished`` each agent's finish since,
    both on the host's monotonic clock as the simulator's). A turn is one request; an
    agent's turns are its requests in the order their batches were created. A hedge the
    sync API won shows as the agent's next batch created, or the agent finished, before
    the batch it was waiting on ended."""
    seen: dict[int, list[tuple[float, float, Turn]]] = {}
    for job in jobs:
        if job["created"] < started or job.get("end") is None:
            continue
        for item in job["items"]:
            m = CUSTOM_ID.search(str(item["custom_id"]))
            if m is None:
                continue
            seen.setdefault(int(m["index"]), []).append((job["created"], job["end"], Turn(
                job["end"] - job["created"], int(item["prompt_tokens"]),
                int(item["completion_tokens"]))))
    out: dict[int, AgentTurns] = {}
    for index, rows in seen.items():
        rows.sort(key=lambda r: r[0])
        done = finished.get(index)
        cut = done is None or any(rows[k + 1][0] < rows[k][1] for k in range(len(rows) - 1)) \
            or started + done < rows[-1][1]
        overhead = None if cut or done is None else (
            done - sum(r[2].batch_s for r in rows)) / len(rows)
        out[index] = AgentTurns(tuple(r[2] for r in rows), overhead)
    return out


def bound(agents: Mapping[int, AgentTurns], deadline_s: float, sync_turn_s: float,
          prices: Mapping[str, float], overhead_s: float | None = None) -> dict[str, Any]:
    """The clairvoyant routing summed over ``agents`` at ``deadline_s``: its cost, late
    agents and turns sent sync. A batch turn takes its batch latency plus its agent's
    overhead (``overhead_s`` for all when given, else the agent's own, else the median of
    those known); a sync turn ``sync_turn_s``."""
    known = [a.overhead_s for a in agents.values() if a.overhead_s is not None]
    median = statistics.median(known) if known else 0.0
    cost = 0.0
    late = sync_turns = 0
    all_sync = 0.0
    for a in agents.values():
        o = overhead_s if overhead_s is not None else (
            a.overhead_s if a.overhead_s is not None else median)
        usage = [Usage(prompt_tokens=t.prompt_tokens, completion_tokens=t.completion_tokens)
                 for t in a.turns]
        sync_usd = [cost_usd(u, prices) for u in usage]
        choice = cheapest_routing([t.batch_s + o for t in a.turns], [sync_turn_s] * len(usage),
                                  [cost_usd(u, prices, batch=True) for u in usage], sync_usd,
                                  deadline_s)
        cost += choice.cost_usd
        all_sync += sum(sync_usd)
        late += choice.late
        sync_turns += sum(choice.sync)
    return {"cost_usd": round(cost, 6), "all_sync_usd": round(all_sync, 6), "late": late,
            "sync_turns": sync_turns, "overhead_median_s": round(median, 3)}


def batch_misses(agents: Mapping[int, AgentTurns], deadline_s: float,
                 overhead_s: float | None = None) -> int:
    """Agents whose all-batch finish in this model (no hedge) passes ``deadline_s``: set
    beside the all-batch pass's measured misses, which its hedges lowered."""
    known = [a.overhead_s for a in agents.values() if a.overhead_s is not None]
    median = statistics.median(known) if known else 0.0
    late = 0
    for a in agents.values():
        o = overhead_s if overhead_s is not None else (
            a.overhead_s if a.overhead_s is not None else median)
        late += sum(t.batch_s + o for t in a.turns) > deadline_s
    return late
