"""A model's price table and what an agent's tokens cost (pure: no I/O but reading the file).

``prices=`` (or ``AGENTBATCH_PRICES`` naming a YAML or JSON file) maps a model name to its
US dollars per million tokens::

    gpt-4o-mini: {prompt: 0.15, cached_prompt: 0.075, completion: 0.6,
                  batch_prompt: 0.075, batch_cached_prompt: 0.0375, batch_completion: 0.3}

``prompt`` and ``completion`` are required; ``cached_prompt`` defaults to ``prompt`` (a server
that reports no cache discount charges full price), and each ``batch_`` price is needed only
for turns sent through a provider's batch API. The table is checked at submit, before
anything is enqueued, so a typo costs nothing; the plan carries the batch model's entry, so
every worker prices a result the same way.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from agentbatch.core.errors import BatchSpecError
from agentbatch.core.model_io import Usage

if TYPE_CHECKING:
    from agentbatch.core.agent_state import AgentState

PRICES_ENV = "AGENTBATCH_PRICES"
SYNC_KEYS = ("prompt", "cached_prompt", "completion")
BATCH_KEYS = tuple(f"batch_{k}" for k in SYNC_KEYS)
PRICE_KEYS = (*SYNC_KEYS, *BATCH_KEYS)
REQUIRED_KEYS = ("prompt", "completion")
PER_TOKENS = 1_000_000

ModelPrices = dict[str, float]
PriceTable = dict[str, ModelPrices]


def _read_file(path: str | os.PathLike[str], where: str) -> Any:
    """The parsed file: JSON for ``.json``, else YAML (which reads JSON too)."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise BatchSpecError(f"{where}: price file {os.fspath(path)!r} could not be read: "
                             f"{exc}") from None
    try:
        return json.loads(text) if file.suffix.lower() == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise BatchSpecError(f"{where}: price file {os.fspath(path)!r} is not valid "
                             f"{'JSON' if file.suffix.lower() == '.json' else 'YAML'}: "
                             f"{str(exc)[:300]}") from None


def _check_entry(model: str, entry: Any, where: str) -> ModelPrices:
    if not isinstance(entry, Mapping):
        raise BatchSpecError(f"{where}[{model!r}] must map price names ({', '.join(PRICE_KEYS)}) "
                             f"to USD per million tokens, got {type(entry).__name__}")
    unknown = sorted(str(k) for k in entry if k not in PRICE_KEYS)
    if unknown:
        raise BatchSpecError(f"{where}[{model!r}]: unknown price name(s) {', '.join(unknown)}; "
                             f"known: {', '.join(PRICE_KEYS)}")
    missing = [k for k in REQUIRED_KEYS if k not in entry]
    if missing:
        raise BatchSpecError(f"{where}[{model!r}] needs {' and '.join(missing)} (USD per "
                             "million tokens)")
    out: ModelPrices = {}
    for key, value in entry.items():
        if (isinstance(value, bool) or not isinstance(value, int | float)
                or not math.isfinite(value) or value < 0):
            raise BatchSpecError(f"{where}[{model!r}][{key!r}] must be a finite number >= 0 "
                                 f"(USD per million tokens), got {value!r}")
        out[key] = float(value)
    return out


def load_prices(value: Any, model: str | None) -> PriceTable | None:
    """``prices`` as given (a mapping, or a YAML/JSON file path), checked, cut down to
    ``model``'s entry; None when no prices were given. ``BatchSpecError`` names ``prices``."""
    if value is None:
        return None
    where = "prices"
    if isinstance(value, str | os.PathLike):
        where = f"prices ({os.fspath(value)})"
        value = _read_file(value, "prices")
    if not isinstance(value, Mapping) or not value:
        raise BatchSpecError(f"{where} must map model names to their prices, e.g. "
                             "{'my-model': {'prompt': 0.15, 'completion': 0.6}}, got "
                             f"{type(value).__name__ if value else repr(value)}")
    if model is None or model not in value:
        have = ", ".join(sorted(map(str, value)))[:300]
        raise BatchSpecError(f"{where} has no entry for the batch's model {model!r} "
                             f"(it has: {have})")
    return {model: _check_entry(model, value[model], where)}


def price(prices: Mapping[str, float], key: str) -> float:
    """One price; ``cached_prompt`` falls back to ``prompt`` (and ``batch_cached_prompt`` to
    ``batch_prompt``). A missing batch price is a ``KeyError`` naming it."""
    if key in prices:
        return prices[key]
    if key.endswith("cached_prompt"):
        return price(prices, key.replace("cached_prompt", "prompt"))
    raise KeyError(f"the price table has no {key!r}")


def batch_price_ratio(prices: Mapping[str, float] | None, default: float) -> float:
    """What a provider batch turn costs against a sync one: the batch price over the sync
    price, the larger of the prompt's and the completion's (a turn's token mix is not known
    when it is routed, so the dearer case decides). ``default`` without a price table or
    batch prices; 1 where the sync price is 0 (a batch can save nothing)."""
    if not prices:
        return default
    ratios = []
    for kind in ("prompt", "completion"):
        try:
            sync, batch = price(prices, kind), price(prices, f"batch_{kind}")
        except KeyError:
            return default
        ratios.append(batch / sync if sync > 0 else 1.0)
    return max(ratios)


def cost_usd(usage: Usage, prices: Mapping[str, float], *, batch: bool = False) -> float:
    """What ``usage`` costs: uncached prompt, cached prompt and completion tokens each at
    their price (the ``batch_`` ones for a provider batch turn)."""
    pre = "batch_" if batch else ""
    cached = min(usage.cached_tokens, usage.prompt_tokens)
    total = ((usage.prompt_tokens - cached) * price(prices, f"{pre}prompt")
             + cached * price(prices, f"{pre}cached_prompt")
             + usage.completion_tokens * price(prices, f"{pre}completion"))
    return total / PER_TOKENS


def split_cost(usage: Usage, batch_usage: Usage, prices: Mapping[str, float]) -> float:
    """``usage`` of which ``batch_usage`` went through a provider batch API: that part at
    the ``batch_`` prices, the rest at the sync ones."""
    if batch_usage == Usage():
        return cost_usd(usage, prices)
    sync = Usage(prompt_tokens=max(usage.prompt_tokens - batch_usage.prompt_tokens, 0),
                 cached_tokens=max(usage.cached_tokens - batch_usage.cached_tokens, 0),
                 completion_tokens=max(usage.completion_tokens - batch_usage.completion_tokens,
                                       0))
    return cost_usd(sync, prices) + cost_usd(batch_usage, prices, batch=True)


def state_cost(state: AgentState, prices: Mapping[str, float]) -> float:
    """What an agent has paid at ``prices``: its replies (the provider batch's part at the
    ``batch_`` prices), and the losing requests of its hedged turns at the sync prices. The
    one reckoning of a result's ``cost_usd``, an agent's spend against its cap, and (as a
    difference) what a commit adds to the batch's spend, on both engines."""
    cost = split_cost(state.usage, state.batch_usage, prices)
    if state.hedge_usage is not None:
        cost += cost_usd(state.hedge_usage, prices)
    return cost


def agent_cost(state: AgentState, table: Mapping[str, Mapping[str, float]] | None,
               model: str) -> float | None:
    """``state_cost`` at the plan's prices for ``model``; None when the batch has none."""
    if not table or model not in table:
        return None
    return state_cost(state, table[model])
