"""KEDA watches the Redis lists live workers really read (issue 25, item 5).

With priorities on, kombu keeps each queue as one Redis list per priority step. KEDA's redis
scaler counts one list per trigger, so a ScaledObject that misses a step (or misspells the
``\\x06\\x16`` separator) never sees that backlog. Here the names come from the running
system, not from our own formula: the lists messages of every priority land in, and the
lists each pool's live worker names in its BRPOP.
"""

from __future__ import annotations

import time

import pytest
import redis

from agentbatch.distributed.workers.app import TURN_TASK, client_app
from tests.support.redis_monitor import MonitorRecorder
from tests.unit.test_deploy_manifests import (
    container_argv,
    k8s_objects,
    option,
    pod_containers,
    worker_deployments,
)

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def _watched_lists() -> dict[str, list[str]]:
    """queue -> the listNames of the ScaledObject that scales the Deployment reading it."""
    deployments = worker_deployments()
    watched: dict[str, list[str]] = {}
    for scaled in k8s_objects("ScaledObject").values():
        target = deployments[scaled["spec"]["scaleTargetRef"]["name"]]
        queue = option(container_argv(pod_containers(target)[0]), "--queues")
        assert queue not in watched, f"two ScaledObjects scale the {queue} pool"
        watched[queue] = [t["metadata"]["listName"] for t in scaled["spec"]["triggers"]]
    return watched


def _brpop_keys(commands: list[list[bytes]], queue: str) -> set[str] | None:
    """The keys of a BRPOP that reads ``queue``'s lists (kombu's consumer), if one ran."""
    for command in commands:
        if command and command[0].upper() == b"BRPOP":
            keys = {k.decode() for k in command[1:-1]}  # the last argument is the timeout
            if any(k == queue or k.startswith(queue + "\x06\x16") for k in keys):
                return keys
    return None


def test_each_scaledobject_names_the_lists_its_pools_worker_reads(redis_url, start_workers):
    watched = _watched_lists()
    assert set(watched) == {"inference", "tools"}  # two pools, scaled independently
    client = redis.from_url(redis_url)

    # 1. messages of every priority 0..9, sent through Celery itself, land in these lists
    app = client_app(redis_url)
    for queue in watched:
        for priority in range(10):
            app.send_task(TURN_TASK, args=["keda-test", priority, 0, 1], queue=queue,
                          priority=priority)
    filled = {k.decode() for k in client.keys("*") if client.type(k) == b"list"}
    assert filled == {name for names in watched.values() for name in names}, filled
    assert sum(client.llen(k) for k in filled) == 20

    # 2. each pool's live worker reads exactly its ScaledObject's lists ...
    with MonitorRecorder(redis_url) as monitor:
        for queue in watched:
            start_workers(1, queues=queue, concurrency=2)
        deadline = time.monotonic() + 60
        read: dict[str, set[str] | None] = {}
        while time.monotonic() < deadline:
            read = {q: _brpop_keys(monitor.commands, q) for q in watched}
            if all(read.values()):
                break
            time.sleep(0.2)
    for queue, names in watched.items():
        assert read.get(queue) == set(names), (queue, read.get(queue), names)

    # 3. ... and drains them: nothing is left in any list KEDA watches
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and sum(client.llen(k) for k in filled):
        time.sleep(0.2)
    assert {k: client.llen(k) for k in filled} == dict.fromkeys(filled, 0)
