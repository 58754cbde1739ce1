"""The Kaplan-Meier survival of provider batch latencies that ``Latencies.quantile`` and
``Router.late_turns`` both read, pinned on fixed inputs: ties between ended and open batches,
open batches only, the size filter. The values are what the code gave when the survival was
built twice (once in each); one shared builder must give them all again, to the letter."""

from __future__ import annotations

import pytest

from agentbatch.turnloop.batch_routing import Latencies, Router

# name: (ended latencies, their sizes, open batches as (age, turns))
CASES: dict[str, tuple[list[float], list[int], list[tuple[float, int]]]] = {
    # an open batch as old as an ended one: the censoring counts first (sorted (t, False)
    # before (t, True)), so the survival drops to 0 at 2.0
    "tie": ([1.0, 2.0], [1, 1], [(2.0, 1)]),
    "mixed": ([1.0, 2.0, 2.0, 3.0, 5.0, 8.0], [1, 4, 2, 8, 8, 3],
              [(2.0, 5), (4.0, 2), (6.0, 9), (0.5, 1)]),
    "open_only": ([], [], [(3.0, 2), (1.0, 4)]),
    "ended_only": ([4.0, 1.0, 3.0, 3.0], [2, 2, 2, 2], []),
}

# (case, q, at_least): (quantile, quantile with bound=True)
QUANTILES: dict[tuple[str, float, float], tuple[float | None, float | None]] = {
    ("tie", 0.1, 0): (1.0, 1.0),
    ("tie", 0.5, 0): (2.0, 2.0),
    ("tie", 0.99, 0): (2.0, 2.0),
    ("tie", 0.5, 2): (None, None),  # nothing that big, ended or open
    ("mixed", 0.1, 0): (1.0, 1.0),
    ("mixed", 0.1, 2): (2.0, 2.0),
    ("mixed", 0.1, 5): (3.0, 3.0),
    ("mixed", 0.5, 0): (5.0, 5.0),
    ("mixed", 0.6, 2): (5.0, 5.0),
    ("mixed", 0.9, 0): (8.0, 8.0),
    ("mixed", 0.9, 2): (8.0, 8.0),
    ("mixed", 0.9, 5): (None, 6.0),  # not reached: the oldest open batch of that size
    ("mixed", 0.99, 5): (None, 6.0),
    ("open_only", 0.5, 0): (None, 3.0),
    ("open_only", 0.5, 2): (None, 3.0),
    ("open_only", 0.5, 5): (None, None),
    ("ended_only", 0.1, 0): (1.0, 1.0),
    ("ended_only", 0.5, 0): (3.0, 3.0),  # two ends at 3.0
    ("ended_only", 0.6, 2): (3.0, 3.0),
    ("ended_only", 0.9, 2): (4.0, 4.0),
    ("ended_only", 0.9, 5): (None, None),
}

HORIZONS = (0.0, 0.4, 1.0, 1.5, 2.0, 3.0, 10.0)
# case: late_turns(h) for h in HORIZONS (every size counts)
LATE: dict[str, list[int | None]] = {
    "tie": [1, 1, 1, 1, 1, 1, 1],  # S(2.0) = 0: the open batch counts whole
    "mixed": [17, 17, 16, 15, 6, 5, 0],
    "open_only": [6, 6, 6, 6, 6, 6, 6],  # no latency ended: every open turn
    "ended_only": [None] * len(HORIZONS),  # no open batch known
}


def latencies(case: str) -> Latencies:
    ended, sizes, _ = CASES[case]
    lat = Latencies()
    for seconds, size in zip(ended, sizes, strict=True):
        lat.add(seconds, size)
    return lat


@pytest.mark.parametrize(("case", "q", "at_least"), list(QUANTILES))
def test_quantile_censors_the_open_batches_as_pinned(case: str, q: float,
                                                     at_least: float) -> None:
    running = CASES[case][2]
    got = (latencies(case).quantile(q, at_least, running),
           latencies(case).quantile(q, at_least, running, bound=True))
    assert got == QUANTILES[(case, q, at_least)]


@pytest.mark.parametrize("case", list(LATE))
def test_late_turns_weighs_open_batches_as_pinned(case: str) -> None:
    running = CASES[case][2]
    router = Router("batch", 100.0, total=10, clock=lambda: 0.0, running=lambda: running)
    router.batch_latency = latencies(case)
    assert [router.late_turns(h) for h in HORIZONS] == LATE[case]
