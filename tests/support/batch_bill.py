"""What the simulator charged, read over HTTP (``/sim/stats``): its sync API's tokens at the
list prices plus what its batch APIs billed (``batch_billed``: every request that completed,
whether or not anyone read its answer) at the batch prices. Tests compare agentbatch's spend
with it."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Mapping
from typing import Any

from agentbatch.core.model_io import Usage
from agentbatch.core.pricing import cost_usd


def sim_stats(url: str) -> dict[str, Any]:
    """``/sim/stats`` of the simulator at ``url`` (``http://host:port``)."""
    with urllib.request.urlopen(f"{url}/sim/stats", timeout=30) as reply:
        return dict(json.load(reply))


def billed_batch(stats: dict[str, Any], model: str) -> Usage:
    """The batch APIs' bill for ``model``, as tokens."""
    row = stats["batch_billed"].get(model, {})
    return Usage(prompt_tokens=row.get("prompt_tokens", 0),
                 completion_tokens=row.get("completion_tokens", 0))


def charged_usd(stats: dict[str, Any], model: str, prices: Mapping[str, float]) -> float:
    """What the provider charged: the sync API's tokens (its cached prompt tokens at the
    cached price) plus the batch APIs' bill at the ``batch_`` prices."""
    sync = Usage(prompt_tokens=stats["prompt_tokens"], cached_tokens=stats["cached_tokens"],
                 completion_tokens=stats["completion_tokens"])
    return cost_usd(sync, prices) + cost_usd(billed_batch(stats, model), prices, batch=True)
