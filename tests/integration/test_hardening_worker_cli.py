"""Issue 21 hardening of the worker and the CLI, each against real processes and real Redis.

- item 5: queue messages that pass the raw check but that kombu cannot build into a message
  (an unknown ``body_encoding``, one that is not a string, a delivery record kombu's QoS cannot
  file) used to stop the worker with "Unrecoverable error" and rc 0; they are dead-lettered.
- item 12: `agentbatch ls` and `dead-letters ls` print text from Redis (batch ids, dead-letter
  reasons and raw items) as markup with escape sequences intact; a meta hash with
  ``total=notanint`` crashed `ls` with a traceback.
- item 14: a worker given its URL in ``AGENTBATCH_REDIS_URL`` (as compose and k8s do) kept it,
  password and all, in ``os.environ``, where every tool and subprocess reads it.
- item 18: bad CLI input gave a traceback (``worker --concurrency -1``, ``--pool bogus``,
  ``dead-letters ls`` with Redis down) or was taken silently (``--concurrency 0``,
  ``demo --agents -5``); each is now exit status 2 and one line naming the option.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import redis

from agentbatch import submit_batch
from agentbatch.distributed.state.keys import DEAD_LETTERS
from agentbatch.distributed.workers.app import TURN_TASK, client_app
from agentbatch.distributed.workers.envelope import envelope
from tests.integration.test_worker_redis_url import PASSWORD, UrlWorker, _tool_saw_password
from tests.support.redis_server import RedisServer, free_port
from tests.support.tools import Answer
from tests.support.workers import REPO

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

    from agentbatch.distributed.workers.poison import GuardedMessage, UnbuildableMessage

    payload = json.loads(_unbuildable_items(redis_url)["encoding_bogus"])
    with Connection(redis_url) as conn, pytest.raises(UnbuildableMessage, match="AttributeError"):
        GuardedMessage(payload, channel=conn.default_channel)


# a terminal acts on these: set the title, clear the screen, draw a clickable link
HOSTILE = ("\x1b]0;pwned\x07\x1b[2J\x1b]8;;http://evil.example/\x1b\\click\x1b]8;;\x1b\\"
           "\x9b31m\u202e[bold red]markup[/] [link=http://evil.example/]L[/link]")


def _agentbatch(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The real CLI in a subprocess; a wide COLUMNS so rich does not fold what we look for."""
    return subprocess.run([sys.executable, "-m", "agentbatch.cli", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=120,
                          env={**os.environ, "COLUMNS": "2000", **(env or {})})


def _assert_inert(out: str) -> None:
    """No control character reached the terminal, and the markup is shown as typed."""
    bad = sorted({hex(ord(c)) for c in out if not (c.isprintable() or c == "\n")})
    assert not bad, (bad, out)
    assert "[bold red]markup[/]" in out and "[link=http://evil.example/]L[/link]" in out, out


def test_ls_shows_hostile_batch_ids_inert_and_a_damaged_meta_as_damaged(redis_url):
    r = redis.from_url(redis_url, decode_responses=True)
    r.hset(f"ab:{{{HOSTILE}}}:meta", mapping={"total": 2, "delivered": 1,
                                               "created_at": time.time()})
    r.hset("ab:{broken}:meta", mapping={"total": "notanint", "delivered": 0})
    r.hset("ab:{fine}:meta", mapping={"total": 3, "delivered": 3, "finished": 1,
                                      "created_at": time.time()})
    out = _agentbatch("ls", "--redis-url", redis_url)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    _assert_inert(out.stdout)
    (broken,) = [line for line in out.stdout.splitlines() if "broken" in line]
    assert "damaged" in broken, out.stdout
    (fine,) = [line for line in out.stdout.splitlines() if "fine" in line]
    assert "finished" in fine and "3/3" in fine, out.stdout
    listed = _agentbatch("ls", "--json", "--no-sizes", "--redis-url", redis_url)
    assert listed.returncode == 0, listed.stderr
    rows = {x["batch_id"]: x for x in map(json.loads, listed.stdout.splitlines())}
    assert rows["broken"]["status"] == "damaged" and HOSTILE in rows, rows


def test_dead_letters_ls_shows_hostile_letters_inert(redis_url):
    r = redis.from_url(redis_url, decode_responses=True)
    r.lpush(DEAD_LETTERS, json.dumps({"id": HOSTILE, "at": time.time(), "queue": HOSTILE,
                                      "reason": HOSTILE, "size": 3, "raw": HOSTILE}))
    r.lpush(DEAD_LETTERS, json.dumps({"id": "far-future", "at": 1e300, "queue": "tools",
                                      "reason": "r", "size": 1, "raw": "x"}))
    r.lpush(DEAD_LETTERS, "hand pushed " + HOSTILE)
    out = _agentbatch("dead-letters", "ls", "--redis-url", redis_url)
    assert out.returncode == 0, out.stderr
    assert "3 dead letter" in out.stdout, out.stdout
    _assert_inert(out.stdout)
    assert "far-future" in out.stdout, out.stdout


@pytest.fixture
def password_url() -> Iterator[str]:
    """A throwaway redis-server with a password; yields its URL (password in it)."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not installed (.ci/run installs it)")
    server = RedisServer(password=PASSWORD).start()
    yield server.url
    server.cleanup()


@pytest.mark.slow
@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_a_worker_scrubs_the_redis_url_from_its_environment(password_url, sim_url, pool):
    """The URL only in the environment: the worker connects with it, then tools (in the
    worker, in a prefork child, in their subprocesses) no longer find the password there."""
    url = password_url
    assert PASSWORD in url
    worker = UrlWorker(["--pool", pool], url_in_env=url).start()
    assert not _tool_saw_password(url, worker, sim_url)


NOWHERE = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there


@pytest.mark.parametrize(("args", "option"), [
    (["worker", "--concurrency", "-1", "--redis-url", NOWHERE], "--concurrency"),
    (["worker", "--concurrency", "0", "--redis-url", NOWHERE], "--concurrency"),
    (["worker", "--pool", "bogus", "--redis-url", NOWHERE], "--pool"),
    (["dead-letters", "ls", "--redis-url", NOWHERE], "--redis-url"),
    (["dead-letters", "drop", "--all", "--redis-url", NOWHERE], "--redis-url"),
    (["demo", "--agents", "-5"], "--agents"),
    (["demo", "--agents", "0"], "--agents"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_bad_cli_input_is_one_clear_error(args, option):
    out = _agentbatch(*args, env={"AGENTBATCH_WORKER_IMPORTS": "tests.support"})
    assert out.returncode == 2, (out.returncode, out.stdout[-2000:], out.stderr[-2000:])
    assert "Traceback" not in out.stderr and option in out.stderr, out.stderr
