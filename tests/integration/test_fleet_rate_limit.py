"""``@tool(rate_limit=...)`` holds fleet-wide on the distributed engine (issue 10, item 4).

Real redis-server, four real tool workers plus one inference worker, the simulator over HTTP.
Every execution records its start (Redis ``TIME``); the achieved rate over the run must stay
within the tool's limit (the bucket's burst of 1 allows no more than one extra call). With a
per-process bucket, four workers ran the tool at about four times its limit.
"""

from __future__ import annotations

import uuid

import pytest
import redis

from agentbatch import submit_batch
from tests.support.rate_tools import RATE, limited_fetch

pytestmark = [pytest.mark.redis, pytest.mark.slow]

IMPORTS = {"AGENTBATCH_WORKER_IMPORTS": "tests.support"}
CALLS = 60


def achieved_rate(starts: list[float]) -> float:
    """Executions per second between the first and the last start (burst excluded)."""
    starts = sorted(starts)
    return (len(starts) - 1) / (starts[-1] - starts[0])


def test_four_tool_workers_share_one_bucket(start_workers, redis_url: str,
                                            sim_url: str) -> None:
    start_workers(1, queues="inference", concurrency=8, env=IMPORTS)
    start_workers(4, queues="tools", concurrency=8, env=IMPORTS)
    tag = uuid.uuid4().hex[:8]
    task = f'Agent {{i}}.\n@sim tool limited_fetch {{{{"tag": "{tag}", "n": {{i}}}}}}'
    handle = submit_batch(task, [{"i": i} for i in range(CALLS)], tools=[limited_fetch],
                          backend=sim_url, model="sim-model", redis_url=redis_url)
    results = handle.wait(timeout=150)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    starts = [float(s) for s in redis.from_url(redis_url).lrange(f"test:rate:{tag}", 0, -1)]
    assert len(starts) == CALLS
    rate = achieved_rate(starts)
    print(f"achieved {rate:.2f}/s with 4 tool workers, limit {RATE}/s")
    assert rate <= RATE * 1.1, f"{rate:.2f}/s against a fleet-wide limit of {RATE}/s"
