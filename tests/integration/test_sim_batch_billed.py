"""The simulator's ledger of what its batch APIs billed (``/sim/stats`` ``batch_billed``),
over real HTTP: a request that completed is billed even when its batch is cancelled later
and nobody reads its answer; one cancelled (or held) before it completed is free; and
``/sim/reset`` starts the ledger again."""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

from agentbatch.sim import SimServer
from agentbatch.sim.config import SimConfig
from tests.support.batch_bill import sim_stats
from tests.support.provider_batch import MODEL, jobs


def post(url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        return dict(json.load(reply))


def params(text: str) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 32, "messages": [{"role": "user", "content": text}]}


def test_completed_batch_requests_are_billed_even_in_a_cancelled_batch() -> None:
    with SimServer(SimConfig(fixed_ms=5, batch_latency_s=0.2,
                             batch_latency_spread=0.0)) as sim:
        posted = time.monotonic()  # the done request completes 0.2 s after the POST, not before
        job = post(f"{sim.url}/v1/messages/batches", {"requests": [
            {"custom_id": "done", "params": params("hello")},
            {"custom_id": "held", "params": params("hello\n@simbatch hold")}]})
        first = sim_stats(sim.url)["batch_billed"]
        if time.monotonic() - posted < 0.2:  # read before anything could complete
            assert first == {}, first
        stop = time.monotonic() + 30
        while not sim_stats(sim.url)["batch_billed"]:
            assert time.monotonic() < stop, "the batch's first request never completed"
            time.sleep(0.05)
        post(f"{sim.url}/v1/messages/batches/{job['id']}/cancel")
        time.sleep(0.3)  # past any request's latency: the held one would not have finished
        billed = sim_stats(sim.url)["batch_billed"]
        assert billed[MODEL]["requests"] == 1, billed  # the completed one; the held is free
        [done] = [i for j in jobs(sim) for i in j.items if i.custom_id == "done"]
        assert billed[MODEL]["prompt_tokens"] == done.prompt_tokens > 0
        assert billed[MODEL]["completion_tokens"] == done.completion_tokens > 0
        post(f"{sim.url}/sim/reset")
        assert sim_stats(sim.url)["batch_billed"] == {}
