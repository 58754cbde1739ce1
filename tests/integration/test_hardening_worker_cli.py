"""Issue 21 hardening of the worker and the CLI, each against real processes and real Redis.

- item 5: queue messages that pass the raw check but that kombu cannot build into a message
  (an unknown ``body_encoding``, one that is not a string, a delivery record kombu's QoS cannot
  file) used to stop the worker with "Unrecoverable error" and rc 0; they are dead-lettered.
"""

from __future__ import annotations

import json
import time

import pytest
import redis

from agentbatch import submit_batch
from agentbatch.state.keys import DEAD_LETTERS
from agentbatch.workers.app import TURN_TASK, client_app
from agentbatch.workers.envelope import envelope
from tests.support.tools import Answer

pytestmark = [pytest.mark.redis]


def _unbuildable_items(redis_url: str) -> dict[str, str]:
    """Envelopes that are JSON with every field check_raw looked at, yet kombu cannot build."""
    _, good = envelope(client_app(redis_url), TURN_TASK, ["no-such-batch", 0, 0], "inference", 9)
    items = {}
    for kind, change in {
        "encoding_bogus": {"body_encoding": "bogus"},
        "encoding_int": {"body_encoding": 7},
        "tag_list": {"delivery_tag": ["a"]},
        "no_routing_key": {"delivery_info": {}},
    }.items():
        payload = json.loads(good)
        payload["properties"].update(change)
        items[kind] = json.dumps(payload)
    return items


def _poll(check, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout}s")


@pytest.mark.slow
def test_an_unbuildable_message_is_dead_lettered_and_the_worker_keeps_serving(
        redis_url, sim_url, start_workers):
    r = redis.from_url(redis_url, decode_responses=True)
    items = _unbuildable_items(redis_url)
    for raw in items.values():
        r.lpush("inference", raw)
    (worker,) = start_workers(1, concurrency=2)
    pid = worker.proc.pid
    _poll(lambda: r.llen(DEAD_LETTERS) >= len(items) or not worker.alive,
          "dead letters written")
    assert worker.alive, (worker.proc.returncode, worker.log()[-3000:])
    letters = [json.loads(x) for x in r.lrange(DEAD_LETTERS, 0, -1)]
    assert len(letters) == len(items), letters
    for kind, raw in items.items():
        match = [x for x in letters if x["raw"] == raw]
        assert len(match) == 1 and match[0]["queue"] == "inference", (kind, letters)
    reasons = " ".join(x["reason"] for x in letters)
    assert "'bogus'" in reasons and "7" in reasons, reasons

    handle = submit_batch("Agent {i}.", [{"i": i} for i in range(3)], model="sim-model",
                          backend=sim_url, redis_url=redis_url, output_schema=Answer)
    results = handle.wait(timeout=180)
    assert all(x.ok for x in results), [x.error for x in results if not x.ok]
    assert worker.alive and worker.proc.pid == pid
    assert r.hlen("unacked") == 0
    log = worker.log()
    assert "Unrecoverable error" not in log, log[-3000:]


def test_whatever_kombu_raises_while_building_a_message_is_a_poison_message(redis_url):
    """The catch-all behind check_raw: the build's own error, as a dead-letter reason."""
    from kombu import Connection

    from agentbatch.workers.poison import GuardedMessage, UnbuildableMessage

    payload = json.loads(_unbuildable_items(redis_url)["encoding_bogus"])
    with Connection(redis_url) as conn, pytest.raises(UnbuildableMessage, match="AttributeError"):
        GuardedMessage(payload, channel=conn.default_channel)
