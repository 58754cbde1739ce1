"""Options are declared once: ``BatchOptions`` for a batch, ``Tool``'s fields for a tool.

Everything else is derived from those declarations; these tests fail when a copy drifts (a
public signature, a default, a plan field, a doc, a pickled Tool, a Literal and its checker).
"""

from __future__ import annotations

import inspect
import pickle
import typing
from dataclasses import MISSING, fields

import pytest

from agentbatch import arun_batch, asubmit_batch, run_batch, submit_batch, tool
from agentbatch.core.errors import BatchSpecError, UnknownParameter
from agentbatch.core.options import BatchOptions, Pricing, ToolCalling, ToolChoice
from agentbatch.core.plan import BatchPlan, carried_options
from agentbatch.toolpool import Tool
from agentbatch.turnloop.compile import compile_batch
from agentbatch.turnloop.json_tool_calling import MODES
from agentbatch.turnloop.tool_choice import CHOICES
from agentbatch.turnloop.validate import PRICINGS

PUBLIC = (run_batch, arun_batch, submit_batch, asubmit_batch)
SIM = "sim://127.0.0.1:8000"


@tool
def lookup(key: str) -> str:
    """Look a key up."""
    return key


def _declared() -> dict[str, object]:
    return {f.name: (inspect.Parameter.empty if f.default is MISSING else f.default)
            for f in fields(BatchOptions)}


@pytest.mark.parametrize("fn", PUBLIC, ids=lambda f: f.__name__)
def test_every_option_is_a_public_parameter_with_the_declared_default(fn):
    params = inspect.signature(fn).parameters
    assert {name: p.default for name, p in params.items()} == _declared()
    assert list(params)[:2] == ["task", "inputs"]
    assert all(p.kind is p.KEYWORD_ONLY for p in list(params.values())[2:])
    for f in fields(BatchOptions):  # help() shows each field's doc
        assert f"{f.name}: {f.metadata['doc'].split()[0]}" in (fn.__doc__ or "")


def test_every_plan_option_is_declared_with_the_same_default_and_round_trips():
    declared = _declared()
    carried = carried_options()
    assert len(carried) >= 15, carried  # the worker-side limits, flags and modes
    for name in carried:
        if name != "tool_calling":  # the plan holds it resolved from "auto"
            assert BatchPlan.model_fields[name].default == declared[name], name
    chosen = {"max_turns": 3, "max_retries": 0, "max_inflight": 7, "timeout_per_turn": 9.5,
              "timeout_per_tool": 4.0, "max_tokens": 11, "temperature": 0.5,
              "native_json_schema": False, "warm_prefix": False, "batch_prompting": False,
              "max_server_waiting": 2, "max_tool_calls_per_turn": 5,
              "max_tool_output_chars": 99, "tool_calling": "native", "tool_choice": "required",
              "max_context_tokens": 5000, "compaction": "truncate", "compaction_threshold": 0.5,
              "prices": {"m": {"prompt": 1.0, "completion": 2.0, "batch_prompt": 0.5,
                               "batch_completion": 1.0}}, "keep_transcript": True,
              "max_cost_usd": 2.5, "max_agent_cost_usd": 0.5, "pricing": "batch",
              "required_tool_rounds": 2}
    # hedge_after: refused with pricing="batch" (no sync turn to hedge), round-tripped in
    # test_hedge_after_is_declared_and_carried_by_the_plan
    # pool_routing / pool_load_factor: need a pool, round-tripped in
    # tests/unit/test_pool_options.py
    assert set(chosen) | {"hedge_after", "pool_routing", "pool_load_factor"} == set(carried)
    # json tool calling needs the schema sent: each value differs from its default in one
    # (and batch prompting tool turns needs json mode)
    json_mode = {"native_json_schema": True, "tool_calling": "json", "batch_prompting": True}
    for case in (chosen, {**chosen, **json_mode}):
        opts = BatchOptions(task="say {x}", inputs=[{"x": 1}], model="m", backend=SIM,
                            tools=[lookup], **case)
        plan = compile_batch(opts).plan
        again = BatchPlan.model_validate_json(plan.model_dump_json())
        assert {name: getattr(again, name) for name in case} == case
        assert again == plan


def test_a_plan_written_without_an_option_reads_as_its_default():
    plan = BatchPlan.model_validate_json(
        '{"batch_id": "b", "total": 1, "model": "m", "backends": ["sim://x:1"], '
        '"system_message": "s"}')
    assert plan.max_tool_output_chars == _declared()["max_tool_output_chars"]
    assert plan.max_turns == _declared()["max_turns"]


def test_literals_and_their_checkers_agree():
    assert typing.get_args(ToolCalling) == MODES
    assert typing.get_args(ToolChoice) == CHOICES
    assert typing.get_args(Pricing) == PRICINGS == ("sync", "batch", "auto")
    with pytest.raises(BatchSpecError, match="pricing must be one of"):
        run_batch("t {x}", [{"x": 1}], model="m", backend=SIM, pricing="cheap")


def test_deadline_reaches_workers_as_one_instant_not_as_the_option():
    # "seconds from submit" means one instant fleet-wide: the submitter turns it into
    # ``deadline_at`` (Redis's clock), the plan never carries the option as given
    declared = _declared()
    assert "deadline" in declared
    assert "deadline" not in carried_options()
    assert "deadline_at" in BatchPlan.model_fields and "pricing" in carried_options()
    with pytest.raises(BatchSpecError, match="tool_calling must be one of"):
        run_batch("t {x}", [{"x": 1}], model="m", backend=SIM, tool_calling="jsn")


def test_unknown_option_and_missing_model_keep_their_messages(monkeypatch):
    with pytest.raises(UnknownParameter, match=r"run_batch\(\) got an unexpected keyword "
                                               r"argument 'max_turn'; did you mean 'max_turns'"):
        run_batch("t", [], model="m", backend=SIM, max_turn=3)
    monkeypatch.delenv("AGENTBATCH_MODEL", raising=False)
    with pytest.raises(BatchSpecError, match="model is required"):
        submit_batch("t", [], backend=SIM)
    with pytest.raises(TypeError, match=r"submit_batch\(\): missing a required argument"):
        submit_batch("t", model="m", backend=SIM)


def _tool_options() -> dict[str, object]:
    built = {"name", "fn", "parameters", "import_path", "spec"}
    return {f.name: f.default for f in fields(Tool) if f.init and f.name not in built}


def test_tool_decorator_takes_every_tool_option_with_its_default():
    typed = inspect.signature(typing.get_overloads(tool)[1]).parameters
    assert set(typed) - {"fn", "name"} == set(_tool_options())
    shown = inspect.signature(tool).parameters
    assert {n: p.default for n, p in shown.items() if n not in ("fn", "name")} \
        == _tool_options()
    for name in _tool_options():
        assert f"    {name}: " in (tool.__doc__ or "")
    with pytest.raises(TypeError, match="unexpected keyword argument 'cachable'; did you "
                                        "mean 'cacheable'"):
        tool(cachable=True)


def test_a_pickled_tool_keeps_every_option():
    copied = pickle.loads(pickle.dumps(_copyable))
    assert _copyable.import_path is None  # so pickled with its options, not re-imported
    assert copied.name == _copyable.name
    for name in _tool_options():
        assert getattr(copied, name) == getattr(_copyable, name), name


def _plain(key: str) -> str:
    """Look a key up."""
    return key


_copyable = Tool("lookup", _plain, cacheable=True, rate_limit=3.0, timeout=2.0, version="v9",
                 coalesce=True, share="fleet", lock_ttl=7.0, max_output_chars=40,
                 description="find")


def test_hedge_after_is_declared_and_carried_by_the_plan():
    # a worker turns hedging on for the pool it opens (distributed/workers/hedging.py)
    assert _declared()["hedge_after"] is None
    assert "hedge_after" in carried_options()
    opts = BatchOptions(task="say {x}", inputs=[{"x": 1}], model="m",
                        backend=[SIM, "sim://127.0.0.1:8001"], hedge_after=2.5)
    plan = compile_batch(opts).plan
    assert BatchPlan.model_validate_json(plan.model_dump_json()).hedge_after == 2.5
    with pytest.raises(BatchSpecError, match="hedge_after must be a finite number > 1"):
        run_batch("t {x}", [{"x": 1}], model="m", backend=[SIM, "sim://127.0.0.1:8001"],
                  hedge_after=1)
