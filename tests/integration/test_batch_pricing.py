"""pricing="batch" | "auto" with deadline= on the embedded engine, over real HTTP to the
simulator's provider batch API: which API served each turn (the sim's chat requests vs the
items of its provider batches, and each agent's ``batch_turns``), what it cost, and that a
deadline the batch latency would miss moves turns to the sync API. Bad input is refused
before anything is sent (the distributed engine's pricing="batch" | "auto" and deadline= are
tested in test_distributed_provider_batch.py and test_distributed_auto_pricing.py)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta, timezone

import pytest

from agentbatch import BatchSpecError, submit_batch
from agentbatch.core.model_io import Usage
from agentbatch.core.pricing import cost_usd
from agentbatch.sim import SimServer
from agentbatch.sim.batch_api import BATCH_API
from agentbatch.sim.config import SimConfig
from tests.support.http_server import ThreadedServer
from tests.support.provider_batch import MODEL, PRICES, chat_only, chat_requests
from tests.support.provider_batch import batch_items as _batch_items
from tests.support.provider_batch import sim_url as _url
from tests.support.tools import Answer, lookup

TASK = 'Agent {i}.\n@sim tool lookup {{"key": "k{i}"}}'  # two turns: a tool call, the answer
N = 6
WAIT_S = 180.0  # generous: the machine is shared


def _sim(**batch: float) -> Iterator[SimServer]:
    with SimServer(SimConfig(fixed_ms=5, **batch)) as server:
        yield server


def _run(sim: SimServer, **opts):
    handle = submit_batch(TASK, [{"i": i} for i in range(N)], model=MODEL, backend=_url(sim),
                          tools=[lookup], output_schema=Answer, prices=PRICES,
                          warm_prefix=False, max_turns=3, **opts)
    results = handle.wait(timeout=WAIT_S)
    handle.join(timeout=WAIT_S)  # its provider batches closed too
    assert len(results) == N
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    return handle, results


@pytest.fixture
def fast_batches() -> Iterator[SimServer]:
    yield from _sim(batch_latency_s=0.3, batch_latency_spread=0.0)


@pytest.fixture
def slow_batches() -> Iterator[SimServer]:
    yield from _sim(batch_latency_s=600.0, batch_latency_spread=0.0)


@pytest.fixture
def expiring_batches() -> Iterator[SimServer]:
    yield from _sim(batch_latency_s=600.0, batch_latency_spread=0.0, batch_expire_s=1.0)


def test_pricing_batch_sends_every_turn_through_the_batch_api_at_batch_rates(
        fast_batches) -> None:
    handle, results = _run(fast_batches, pricing="batch")
    stats = handle.stats()["provider_batch"]
    assert _batch_items(fast_batches) == 2 * N  # every turn went out in a provider batch
    # a turn hedged past the p90 of the batches seen went to the sync API too: none here
    # is expected, and any that won is counted and priced at the sync rates
    assert chat_requests(fast_batches) == stats.get("hedged", 0)
    assert stats["served_batch"] == 2 * N - stats.get("hedge_won_by_sync", 0)
    assert sum(r.turns for r in results) == 2 * N
    if not stats.get("hedge_won_by_sync"):
        for r in results:
            assert r.cost_usd == pytest.approx(cost_usd(r.usage, PRICES[MODEL], batch=True))
            assert r.cost_usd < cost_usd(r.usage, PRICES[MODEL])
    # the spend: the results' cost, plus what a provider batch billed for a hedged turn the
    # sync API had already won (in no result: that agent had moved on)
    lost = Usage(prompt_tokens=stats.get("hedge_lost_batch_paid_prompt_tokens", 0),
                 completion_tokens=stats.get("hedge_lost_batch_paid_completion_tokens", 0))
    assert handle.progress().cost_usd == pytest.approx(
        sum(r.cost_usd for r in results) + cost_usd(lost, PRICES[MODEL], batch=True))


def test_auto_with_a_generous_deadline_uses_the_batch_api(fast_batches) -> None:
    handle, results = _run(fast_batches, pricing="auto", deadline=600)
    stats = handle.stats()["provider_batch"]
    assert stats["served_batch"] >= N  # at least the first turn of each agent
    assert sum(r.cost_usd for r in results) < sum(cost_usd(r.usage, PRICES[MODEL])
                                                  for r in results)
    routed = sum(stats.get(f"routed_sync_{why}", 0) for why in ("probe", "tail", "deadline"))
    assert stats.get("routed_sync_probe") == 1  # the first turn measured the sync latency
    assert chat_requests(fast_batches) == routed + stats.get("served_sync", 0) + \
        stats.get("hedged", 0) - stats.get("hedge_won_by_sync", 0)


def test_auto_moves_turns_the_batch_latency_would_make_miss_the_deadline_to_sync(
        slow_batches) -> None:
    deadline = datetime.now(timezone.utc) + timedelta(seconds=20)
    handle, results = _run(slow_batches, pricing="auto", deadline=deadline)
    stats = handle.stats()["provider_batch"]
    # no provider batch can answer inside the deadline (600 s each): every turn was served
    # by the sync API, each agent finished ok, none paid a batch price
    assert all(r.latency_s is not None for r in results)
    # (routed there at once, or sent to a provider batch first and hedged at the deadline)
    routed = sum(stats.get(f"routed_sync_{why}", 0) for why in ("probe", "tail", "deadline"))
    assert stats.get("served_batch", 0) == 0 and stats.get("served_sync", 0) + routed == 2 * N
    assert all(r.cost_usd == pytest.approx(cost_usd(r.usage, PRICES[MODEL])) for r in results)
    assert chat_requests(slow_batches) == 2 * N
    # the provider batches it opened were cancelled once their turns had a sync answer
    api = slow_batches._runner.app[BATCH_API]  # type: ignore[union-attr]
    assert all(job.cancelled is not None for job in api.jobs.values())
    assert stats.get("provider_batches", 0) == stats.get("provider_batches_cancelled", 0)


def test_an_expired_provider_batch_falls_back_to_the_sync_api(expiring_batches) -> None:
    handle, results = _run(expiring_batches, pricing="batch")
    stats = handle.stats()["provider_batch"]
    assert _batch_items(expiring_batches) == 2 * N  # each turn was tried in a batch first
    assert stats["fallback_sync"] == 2 * N and stats.get("served_batch", 0) == 0
    assert chat_requests(expiring_batches) == 2 * N
    assert all(r.cost_usd == pytest.approx(cost_usd(r.usage, PRICES[MODEL])) for r in results)


def test_a_failed_provider_batch_falls_back_to_the_sync_api() -> None:
    for sim in _sim(batch_latency_s=0.2, batch_latency_spread=0.0, batch_failure_rate=1.0):
        handle, _ = _run(sim, pricing="batch")
        stats = handle.stats()["provider_batch"]
        assert stats["fallback_sync"] == 2 * N and chat_requests(sim) == 2 * N


def test_pricing_batch_on_a_backend_without_a_batch_api_is_refused_before_any_turn() -> None:
    with ThreadedServer(chat_only) as server, pytest.raises(BatchSpecError) as err:
        submit_batch("hi {i}", [{"i": 0}], model=MODEL, warm_prefix=False,
                     backend=f"sim://127.0.0.1:{server.port}", pricing="batch")
    assert "pricing='batch'" in str(err.value) and "no provider batch API" in str(err.value)


@pytest.mark.parametrize("opts,needle", [
    ({"pricing": "batch", "deadline": -5}, "deadline is in the past"),
    ({"pricing": "auto", "deadline": datetime.now(timezone.utc) - timedelta(minutes=1)},
     "deadline is in the past"),
    ({"pricing": "auto", "deadline": datetime.now() + timedelta(hours=1)},
     "deadline must be timezone-aware"),
    ({"pricing": "auto", "deadline": float("inf")}, "deadline must be an aware datetime"),
    ({"pricing": "auto"}, 'pricing="auto" needs deadline='),
    ({"deadline": 60}, 'deadline is for pricing="batch" or "auto"'),
    ({"pricing": "cheap"}, "pricing must be one of 'sync', 'batch', 'auto'"),
    ({"pricing": "batch", "prices": {MODEL: {"prompt": 1.0, "completion": 1.0}}},
     "needs batch_prompt and batch_completion"),
])
def test_bad_pricing_options_are_refused_before_anything_is_sent(fast_batches, opts,
                                                                 needle) -> None:
    with pytest.raises(BatchSpecError) as err:
        submit_batch("hi {i}", [{"i": 0}], model=MODEL, backend=_url(fast_batches),
                     **{"prices": PRICES, **opts})
    assert needle in str(err.value)
    assert chat_requests(fast_batches) == 0 and _batch_items(fast_batches) == 0


def test_turns_too_few_for_the_providers_minimum_go_to_the_sync_api_counted(
        fast_batches, monkeypatch) -> None:
    """A provider whose batch jobs need more requests than are ever ready together
    (Bedrock: 100 records per job by default) gets no provider batch: each turn goes to the
    sync API, counted, instead of a submit the provider would refuse."""
    from agentbatch.backends.provider_batch.openai_batch import OpenAIBatchClient

    monkeypatch.setattr(OpenAIBatchClient, "min_items", N + 1)  # N agents: never enough
    handle, results = _run(fast_batches, pricing="batch")
    stats = handle.stats()["provider_batch"]
    assert _batch_items(fast_batches) == 0 and stats.get("provider_batches", 0) == 0
    assert stats["provider_batch_below_min"] == 2 * N
    assert stats["served_sync"] == 2 * N and chat_requests(fast_batches) == 2 * N
    assert all(r.cost_usd == pytest.approx(cost_usd(r.usage, PRICES[MODEL])) for r in results)
