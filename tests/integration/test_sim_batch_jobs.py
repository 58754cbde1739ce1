"""The simulator's provider batch timelines (``/sim/batch_jobs``), over real HTTP: when each
request finishes and when its batch would end, as decided at creation, still there after the
batch was cancelled (what ``bench_cost``'s clairvoyant bound reads)."""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

from agentbatch.sim import SimServer
from agentbatch.sim.config import SimConfig
from tests.support.provider_batch import MODEL, jobs


def post(url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        return dict(json.load(reply))


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as reply:
        return json.load(reply)


def params(text: str) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 32, "messages": [{"role": "user", "content": text}]}


def test_batch_jobs_report_each_requests_finish_and_the_uncut_end_of_a_cancelled_batch() -> None:
    with SimServer(SimConfig(fixed_ms=5, batch_latency_s=30.0, batch_latency_spread=0.5,
                             seed=3)) as sim:
        before = time.monotonic()
        made = post(f"{sim.url}/v1/messages/batches", {"requests": [
            {"custom_id": "a", "params": params("hello")},
            {"custom_id": "b", "params": params("hello there")}]})
        held = post(f"{sim.url}/v1/messages/batches", {"requests": [
            {"custom_id": "h", "params": params("hello\n@simbatch hold")}]})
        post(f"{sim.url}/v1/messages/batches/{made['id']}/cancel")  # long before it ends
        seen = {j["id"]: j for j in get(f"{sim.url}/sim/batch_jobs")}
        truth = {j.id: j for j in jobs(sim)}
        job = seen[made["id"]]
        assert before <= job["created"] == truth[made["id"]].created
        assert job["cancelled"] is not None and job["cancelled"] >= job["created"]
        items = {i["custom_id"]: i for i in job["items"]}
        real = {i.custom_id: i for i in truth[made["id"]].items}
        assert set(items) == {"a", "b"}
        for cid, item in items.items():
            assert item["ready"] == real[cid].ready_at > job["created"] + 1.0  # not the cancel
            assert item["prompt_tokens"] == real[cid].prompt_tokens > 0
            assert item["completion_tokens"] == real[cid].completion_tokens > 0
            assert item["fail"] is False
        assert job["end"] == max(i["ready"] for i in items.values())  # uncut by the cancel
        assert items["a"]["ready"] != items["b"]["ready"]  # per request, not per job
        hold = seen[held["id"]]
        assert hold["end"] is None and hold["items"][0]["ready"] is None
