"""Issue 21, item 14: ``agentbatch rm`` takes the batch's cached tool results with it.

Real redis-server, real ``agentbatch worker`` processes, the simulator over HTTP, the real
``agentbatch rm`` CLI. A cacheable tool's output (here a "private record") is cached and
coalesced in Redis for up to its TTL; deleting the batch must delete those keys too. A
``share="fleet"`` tool's cache is the fleet's, not the batch's: it stays until its TTL.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest
import redis

from agentbatch import submit_batch
from tests.support.pure_tools import shout
from tests.support.tools import Answer, fleet_price
from tests.support.workers import REPO

pytestmark = [pytest.mark.redis, pytest.mark.slow]

WORKER_ENV = {"AGENTBATCH_WORKER_IMPORTS": "tests.support"}


def _holding(r: redis.Redis, text: str) -> list[str]:
    """Every string key whose value contains ``text`` (tool caches and coalesced results)."""
    found = []
    for key in r.scan_iter(count=1000):
        if r.type(key) == "string" and text in (r.get(key) or ""):
            found.append(key)
    return sorted(found)


def test_rm_deletes_the_batchs_cached_tool_results(redis_url, sim_url, start_workers):
    start_workers(1, concurrency=8, env=WORKER_ENV)
    secret = f"private-record-{uuid.uuid4().hex[:8]}"
    item = f"item-{uuid.uuid4().hex[:8]}"
    task = ('Agent {i}.\n@sim tool shout {{"text": "' + secret + '"}}\n'
            '@sim tool fleet_price {{"item": "' + item + '"}}')
    handle = submit_batch(task, [{"i": i} for i in range(4)], model="m", backend=sim_url,
                          redis_url=redis_url, tools=[shout, fleet_price],
                          output_schema=Answer)
    results = handle.wait(timeout=120)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    r = redis.from_url(redis_url, decode_responses=True)
    cached = _holding(r, secret.upper())
    assert cached, "the cacheable tool's result was not cached: nothing to test"
    fleet = _holding(r, f"fleet-price-of-{item}")
    assert fleet

    out = subprocess.run([sys.executable, "-m", "agentbatch.cli", "rm", handle.batch_id],
                         env={**os.environ, "AGENTBATCH_REDIS_URL": redis_url}, cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert _holding(r, secret.upper()) == [], f"left after rm (cached before: {cached})"
    assert _holding(r, f"fleet-price-of-{item}") == fleet  # the fleet's, not the batch's
