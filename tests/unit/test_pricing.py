"""The price table: read from a dict or a YAML/JSON file, checked, and what usage costs."""

from __future__ import annotations

import math

import pytest

from agentbatch.core.agent_state import AgentState
from agentbatch.core.errors import BatchSpecError
from agentbatch.core.model_io import Usage
from agentbatch.core.options import BatchOptions, with_environment
from agentbatch.core.pricing import PRICES_ENV, agent_cost, cost_usd, load_prices
from agentbatch.turnloop.compile import compile_batch

PRICES = {"m": {"prompt": 2.0, "cached_prompt": 0.5, "completion": 8.0,
                "batch_prompt": 1.0, "batch_completion": 4.0}}
SIM = "sim://127.0.0.1:8000"


def test_cost_prices_uncached_cached_and_completion_tokens_per_million() -> None:
    usage = Usage(prompt_tokens=1_000_000, cached_tokens=400_000, completion_tokens=250_000)
    # 600k uncached at 2.0, 400k cached at 0.5, 250k completion at 8.0
    assert cost_usd(usage, PRICES["m"]) == pytest.approx(1.2 + 0.2 + 2.0)
    # batch: cached falls back to batch_prompt (no batch_cached_prompt given)
    assert cost_usd(usage, PRICES["m"], batch=True) == pytest.approx(1.0 + 1.0)
    assert cost_usd(Usage(), PRICES["m"]) == 0.0


def test_cached_prompt_defaults_to_prompt_and_a_missing_batch_price_is_named() -> None:
    usage = Usage(prompt_tokens=10, cached_tokens=10, completion_tokens=0)
    assert cost_usd(usage, {"prompt": 3.0, "completion": 1.0}) == pytest.approx(30e-6)
    with pytest.raises(KeyError, match="batch_prompt"):
        cost_usd(usage, {"prompt": 3.0, "completion": 1.0}, batch=True)


def test_agent_cost_is_none_without_prices() -> None:
    state = AgentState(index=0, input={}, usage=Usage(prompt_tokens=1_000_000))
    assert agent_cost(state, None, "m") is None
    assert agent_cost(state, {"other": PRICES["m"]}, "m") is None
    assert agent_cost(state, PRICES, "m") == pytest.approx(2.0)


@pytest.mark.parametrize("suffix,text", [
    (".yaml", "m:\n  prompt: 2\n  completion: 8\nother: {prompt: 1, completion: 1}\n"),
    (".json", '{"m": {"prompt": 2, "completion": 8}, "other": {"prompt": 1, "completion": 1}}'),
])
def test_a_price_file_is_read_and_cut_to_the_batch_model(tmp_path, suffix, text) -> None:
    path = tmp_path / f"prices{suffix}"
    path.write_text(text)
    assert load_prices(str(path), "m") == {"m": {"prompt": 2.0, "completion": 8.0}}
    assert load_prices(path, "m") == {"m": {"prompt": 2.0, "completion": 8.0}}


@pytest.mark.parametrize("table,needle", [
    ({"other": {"prompt": 1, "completion": 1}}, "no entry for the batch's model 'm'"),
    ({"m": {"prompt": -1, "completion": 1}}, "prices['m']['prompt'] must be a finite number >= 0"),
    ({"m": {"prompt": 1, "completion": math.inf}}, "['completion'] must be a finite number"),
    ({"m": {"prompt": 1, "completion": math.nan}}, "['completion'] must be a finite number"),
    ({"m": {"prompt": 1, "completion": "1"}}, "['completion'] must be a finite number"),
    ({"m": {"prompt": 1, "completion": True}}, "['completion'] must be a finite number"),
    ({"m": {"prompt": 1}}, "prices['m'] needs completion"),
    ({"m": {"prompt": 1, "completion": 1, "batch_promt": 1}}, "unknown price name(s) batch_promt"),
    ({"m": 3}, "prices['m'] must map price names"),
    ({}, "prices must map model names"),
    ([("m", 1)], "prices must map model names"),
])
def test_bad_price_tables_are_refused_naming_prices(table, needle) -> None:
    with pytest.raises(BatchSpecError) as err:
        load_prices(table, "m")
    assert needle in str(err.value)


def test_a_bad_price_file_is_refused_naming_it(tmp_path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(BatchSpecError, match=r"price file .*nope\.yaml.* could not be read"):
        load_prices(str(missing), "m")
    broken = tmp_path / "p.json"
    broken.write_text("{not json")
    with pytest.raises(BatchSpecError, match="is not valid JSON"):
        load_prices(broken, "m")


def test_compile_refuses_a_table_without_the_model_and_carries_the_entry(tmp_path,
                                                                         monkeypatch) -> None:
    opts = BatchOptions(task="say {x}", inputs=[{"x": 1}], model="m", backend=SIM,
                        prices={"gpt": {"prompt": 1, "completion": 1}})
    with pytest.raises(BatchSpecError, match="prices has no entry for the batch's model 'm'"):
        compile_batch(opts)
    path = tmp_path / "prices.yaml"
    path.write_text("m: {prompt: 2, completion: 8}\ngpt: {prompt: 1, completion: 1}\n")
    monkeypatch.setenv(PRICES_ENV, str(path))
    opts = with_environment(BatchOptions(task="say {x}", inputs=[{"x": 1}], model="m",
                                         backend=SIM))
    plan = compile_batch(opts).plan
    assert plan.prices == {"m": {"prompt": 2.0, "completion": 8.0}}
    assert type(plan).model_validate_json(plan.model_dump_json()) == plan
