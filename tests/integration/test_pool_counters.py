"""What operators see of a pool's moves and hedges, on both engines (issues 26 and 27).

Real simulator processes over HTTP, a real redis-server and real ``agentbatch worker``
processes with their Prometheus endpoints. Moves are provoked by a pool of two simulators,
one SIGKILLed while every agent waits in a tool between its two turns: the second turn of
each agent whose first ran there fails over to the live one. (A first turn has no home, so
an endpoint that is down from the start moves nobody.) Hedges by
the three-simulator pool of ``tests/support/sim_pool.py`` (two fast, one slow). Assertions
are counts: the batch's own (``handle.stats()`` / ``handle.status()``) against the
``/metrics`` counters, never timings.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from agentbatch import submit_batch
from agentbatch.metrics import metrics
from agentbatch.sim import SimConfig
from agentbatch.sim.process import SimProcess, free_port
from tests.integration.test_metrics_names import Samples, _parse, scrape, total
from tests.integration.test_pool_faults import arrived, hold, kill, open_gate, task
from tests.integration.test_pool_hedge import TASK, echo, wait_until
from tests.support.sim_pool import slow_pool
from tests.support.tools import Answer

MOVE_AGENTS = 12  # first turns spread by load: about half run on the one killed
HEDGE_AGENTS = 60  # as test_pool_hedge_distributed: each worker gets its 20 fast answers
WAIT_S = 300.0
# Workers import tools only from listed modules: ``echo`` lives in test_pool_hedge, ``hold``
# in test_pool_faults.
WORKER_ENV = {"AGENTBATCH_WORKER_IMPORTS":
              "tests.support,tests.integration.test_pool_hedge,"
              "tests.integration.test_pool_faults,agentbatch.toolpool.builtins"}


@pytest.fixture
def two_sims() -> Iterator[list[SimProcess]]:
    """A pool of two simulators; the tests kill the second."""
    procs = [SimProcess(SimConfig(fixed_ms=5, port=free_port())) for _ in range(2)]
    for p in procs:
        p.start()
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()


def _submit_and_kill_one(tmp: Path, sims: list[SimProcess], **kw: Any) -> Any:
    """A batch whose agents each wait in ``hold`` after their first turn; once all wait, the
    second simulator is killed and the gate opened: the agents whose first turn it served
    fail over, each a counted move."""
    handle = submit_batch(task(tmp, 1), [{"i": i} for i in range(MOVE_AGENTS)],
                          model="sim-model", output_schema=Answer, tools=[hold],
                          backend=[s.url for s in sims], timeout_per_turn=30, **kw)
    wait_until(lambda: arrived(tmp, 0) == MOVE_AGENTS, "every agent in its tool call")
    kill(sims[1])
    open_gate(tmp, 0)
    return handle


@pytest.fixture
def hedge_pool() -> Iterator[list[SimProcess]]:
    with slow_pool() as (procs, _slow):
        yield procs


def _sum(scrapes: list[Samples], name: str, **labels: str) -> float:
    return sum(total(s, name, **labels) for s in scrapes)


def _workers_with_metrics(start_workers: Any, n: int) -> list[int]:
    ports = [free_port() for _ in range(n)]
    for port in ports:
        start_workers(1, concurrency=8, env=WORKER_ENV, extra_args=["--metrics-port", str(port)])
    return ports


# --- embedded ------------------------------------------------------------------------------


def _this_process() -> Samples:
    """This process's counters now (what an embedded engine's ``/metrics`` serves)."""
    return _parse(generate_latest(metrics().registry).decode())


def test_embedded_metrics_count_the_pools_moves(
        tmp_path: Path, two_sims: list[SimProcess]) -> None:
    port = free_port()
    before = _this_process()  # counters of this process: earlier tests' batches too
    handle = _submit_and_kill_one(tmp_path, two_sims, metrics_port=port)
    results = handle.wait(timeout=WAIT_S)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    moves = handle.stats()["pool"]["moves"]
    assert moves["failover"] >= 1, moves
    after = scrape(port)
    for reason in ("load", "failover"):  # this batch's every move, as it happened
        grew = (total(after, "agentbatch_pool_moves_total", reason=reason)
                - total(before, "agentbatch_pool_moves_total", reason=reason))
        assert grew == moves[reason], (reason, grew, moves)


def test_embedded_metrics_count_hedges_their_outcomes_and_the_losers_tokens(
        hedge_pool: list[SimProcess]) -> None:
    port = free_port()
    urls = [s.url for s in hedge_pool]
    before = _this_process()
    handle = submit_batch(TASK, [{"i": i} for i in range(HEDGE_AGENTS)], model="sim-model",
                          output_schema=Answer, tools=[echo], backend=urls, hedge_after=2.0,
                          timeout_per_turn=60, warm_prefix=False, metrics_port=port)
    results = handle.wait(timeout=WAIT_S)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    hedge = handle.stats()["pool"]["hedge"]
    assert hedge["hedges"] >= 1 and hedge["hedge_wins"] >= 1, hedge
    assert hedge["loser_prompt_tokens"] > 0, hedge
    after = scrape(port)

    def grew(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert grew("agentbatch_hedges_total") == hedge["hedges"]
    for outcome, key in (("hedge_won", "hedge_wins"), ("original_won", "original_wins"),
                         ("both_failed", "both_failed")):
        assert grew("agentbatch_hedge_outcomes_total", outcome=outcome) == hedge[key], outcome
    assert grew("agentbatch_hedge_loser_tokens_total", kind="prompt") \
        == hedge["loser_prompt_tokens"]
    assert grew("agentbatch_hedge_loser_tokens_total", kind="completion") \
        == hedge["loser_completion_tokens"]


# --- distributed ---------------------------------------------------------------------------


@pytest.mark.redis
@pytest.mark.slow
def test_distributed_moves_reach_the_batchs_status_and_the_workers_metrics(
        tmp_path: Path, two_sims: list[SimProcess], redis_url: str,
        start_workers: Any) -> None:
    ports = _workers_with_metrics(start_workers, 2)
    handle = _submit_and_kill_one(tmp_path, two_sims, redis_url=redis_url)
    results = handle.wait(timeout=WAIT_S)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]

    def counted() -> bool:  # the workers' stats flush is in the background
        status = handle.status()
        moved = sum(status.get(f"stat:pool_moves_{r}", 0) for r in ("load", "failover"))
        return moved > 0 and moved == _sum([scrape(p) for p in ports],
                                           "agentbatch_pool_moves_total")

    wait_until(counted, "the moves on the batch and in the workers' metrics", timeout=60)
    status = handle.status()
    assert status.get("stat:pool_moves_failover", 0) >= 1, status
    scrapes = [scrape(p) for p in ports]
    for reason in ("load", "failover"):  # per reason too: one batch ran on these workers
        assert (_sum(scrapes, "agentbatch_pool_moves_total", reason=reason)
                == status.get(f"stat:pool_moves_{reason}", 0)), (reason, status)


@pytest.mark.redis
@pytest.mark.slow
def test_distributed_hedges_count_the_losers_tokens_on_the_batch_and_in_metrics(
        hedge_pool: list[SimProcess], redis_url: str, start_workers: Any) -> None:
    ports = _workers_with_metrics(start_workers, 2)
    urls = [s.url for s in hedge_pool]
    handle = submit_batch(TASK, [{"i": i} for i in range(HEDGE_AGENTS)], model="sim-model",
                          output_schema=Answer, tools=[echo], backend=urls, hedge_after=2.0,
                          timeout_per_turn=60, warm_prefix=False, redis_url=redis_url)
    results = handle.wait(timeout=WAIT_S)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    outcomes = ("hedge_wins", "hedge_original_wins", "hedge_both_failed")

    def counted() -> bool:
        status = handle.status()
        settled = sum(status.get(f"stat:{o}", 0) for o in outcomes)
        return (status.get("stat:hedges", 0) >= 1 and status["stat:hedges"] == settled
                and settled == _sum([scrape(p) for p in ports],
                                    "agentbatch_hedge_outcomes_total"))

    wait_until(counted, "the hedges on the batch and in the workers' metrics", timeout=60)
    status = handle.status()
    # what hedging cost: the losers' prompts at least (a cancelled loser's completion is
    # unknown), on the batch and, the same, in the workers' metrics
    lost = status.get("stat:hedge_loser_prompt_tokens", 0)
    assert lost > 0, status
    scrapes = [scrape(p) for p in ports]
    assert _sum(scrapes, "agentbatch_hedge_loser_tokens_total", kind="prompt") == lost
    assert (_sum(scrapes, "agentbatch_hedge_loser_tokens_total", kind="completion")
            == status.get("stat:hedge_loser_completion_tokens", 0))
    assert _sum(scrapes, "agentbatch_hedges_total") >= status["stat:hedges"]
    for outcome, stat in (("hedge_won", "hedge_wins"), ("original_won", "hedge_original_wins"),
                          ("both_failed", "hedge_both_failed")):
        assert (_sum(scrapes, "agentbatch_hedge_outcomes_total", outcome=outcome)
                == status.get(f"stat:{stat}", 0)), (outcome, status)
