"""Every result carries ``cost_usd`` (its usage at the batch's prices) on both engines, and
``progress()`` the running total; a bad price table is refused before anything is sent or
enqueued. Real HTTP to the simulator; real redis-server and worker processes."""

from __future__ import annotations

import pytest
import redis

from agentbatch import BatchSpecError, run_batch, submit_batch
from agentbatch.core.pricing import cost_usd
from tests.support.tools import Answer, lookup

PRICES = {"sim-model": {"prompt": 3.0, "cached_prompt": 0.3, "completion": 15.0},
          "other": {"prompt": 1.0, "completion": 1.0}}
TASK = 'Agent {i}.\n@sim tool lookup {{"key": "k{i}"}}'


def _check_costs(results, total: float | None) -> None:
    assert results and all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    for r in results:
        assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
        assert r.cost_usd == pytest.approx(cost_usd(r.usage, PRICES["sim-model"]))
        assert r.cost_usd > 0
    assert total == pytest.approx(sum(r.cost_usd for r in results))


def test_embedded_results_and_progress_carry_cost(sim_url) -> None:
    handle = submit_batch(TASK, [{"i": i} for i in range(12)], model="sim-model",
                          backend=sim_url, tools=[lookup], output_schema=Answer, prices=PRICES)
    results = handle.wait(timeout=120)
    _check_costs(results, handle.progress().cost_usd)


def test_without_prices_cost_is_none(sim_url) -> None:
    (result,) = run_batch("Agent {i}.", [{"i": 0}], model="sim-model", backend=sim_url)
    assert result.ok and result.cost_usd is None


def test_a_price_file_from_the_environment_prices_results(sim_url, tmp_path,
                                                          monkeypatch) -> None:
    path = tmp_path / "prices.yaml"
    path.write_text("sim-model: {prompt: 3.0, cached_prompt: 0.3, completion: 15.0}\n")
    monkeypatch.setenv("AGENTBATCH_PRICES", str(path))
    results = run_batch("Agent {i}.", [{"i": i} for i in range(3)], model="sim-model",
                        backend=sim_url)
    assert all(r.cost_usd == pytest.approx(cost_usd(r.usage, PRICES["sim-model"]))
               for r in results)


@pytest.mark.redis
@pytest.mark.slow
def test_distributed_results_and_progress_carry_cost(redis_url, sim_url, start_workers) -> None:
    start_workers(1, concurrency=8)
    handle = submit_batch(TASK, [{"i": i} for i in range(12)], model="sim-model",
                          backend=sim_url, tools=[lookup], output_schema=Answer,
                          prices=PRICES, redis_url=redis_url)
    results = handle.wait(timeout=180)
    _check_costs(results, handle.progress().cost_usd)


@pytest.mark.redis
@pytest.mark.parametrize("prices,needle", [
    ({"other": {"prompt": 1.0, "completion": 1.0}}, "no entry for the batch's model"),
    ({"sim-model": {"prompt": -0.5, "completion": 1.0}}, "must be a finite number >= 0"),
    ({"sim-model": {"prompt": 1.0, "completion": float("nan")}}, "must be a finite number >= 0"),
])
def test_bad_price_tables_are_refused_before_anything_is_sent_or_enqueued(
        redis_url, sim, sim_url, prices, needle) -> None:
    before = sim.state.stats.as_dict()["requests_total"]
    for kw in ({}, {"redis_url": redis_url}):
        with pytest.raises(BatchSpecError, match="prices") as err:
            submit_batch(TASK, [{"i": 0}], model="sim-model", backend=sim_url, tools=[lookup],
                         prices=prices, **kw)
        assert needle in str(err.value)
    assert sim.state.stats.as_dict()["requests_total"] == before
    assert redis.from_url(redis_url).dbsize() == 0
