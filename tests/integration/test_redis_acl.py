"""Issue 8, item 10: least-privilege Redis users, end to end.

A real redis-server loads the deploy's own ACL file (deploy/redis-users.acl, the file
compose/ and k8s/ use). A batch with tools runs with the submitter user on the submitting
side and the worker user in real worker processes, ``agentbatch flower`` watches with the
flower user, and Redis's ACL LOG shows that none of them was refused anything on the way.
Then each role is shown what it may not do. Before the fix there were no users at all:
everything (submitters, workers, Flower, KEDA) shared one password with every command.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from kombu.exceptions import OperationalError

from agentbatch import submit_batch
from agentbatch.core.errors import BatchSpecError, ConfigError
from agentbatch.distributed.state.keys import BatchKeys, PipelineKeys
from agentbatch.distributed.state.retention import delete_batch
from agentbatch.distributed.workers.app import client_app
from agentbatch.distributed.workers.envelope import queue_key
from tests.support.pure_tools import shout, stamp
from tests.support.redis_server import free_port
from tests.support.secure_redis import AclRedisServer
from tests.support.tools import Answer
from tests.support.workers import REPO, WorkerProcess

pytestmark = [pytest.mark.redis, pytest.mark.slow]

ACL_TEMPLATE = REPO / "deploy" / "redis-users.acl"
AGENTS = 12
ROLES = ("submitter", "worker", "flower", "keda")


@pytest.fixture(scope="module")
def acl_server() -> Iterator[AclRedisServer]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not installed (.ci/run installs it)")
    passwords = {role: secrets.token_hex(16) for role in AclRedisServer.USERS}
    server = AclRedisServer(ACL_TEMPLATE, passwords).start()
    yield server
    server.cleanup()


@pytest.fixture(scope="module")
def admin(acl_server: AclRedisServer) -> redis.Redis:
    return redis.from_url(acl_server.url("admin"), decode_responses=True)


@pytest.fixture(scope="module")
def acl_worker(acl_server: AclRedisServer) -> Iterator[WorkerProcess]:
    """One worker on both queues, connected as agentbatch-worker."""
    worker = WorkerProcess(acl_server.url("worker"), name="aclw", concurrency=8)
    try:
        worker.start()
        yield worker
    finally:
        worker.stop(timeout=15)
        worker.log_path.unlink(missing_ok=True)


def _client(server: AclRedisServer, role: str) -> redis.Redis:
    return redis.from_url(server.url(role), decode_responses=True)


def _denials(admin: redis.Redis) -> list[dict[str, Any]]:
    return [e for e in admin.acl_log(200) if e.get("username", "").startswith("agentbatch-")]


def _refused(client: redis.Redis, *command: Any) -> str:
    """Run ``command``; it must be refused by the ACL (NOPERM). Returns the message."""
    with pytest.raises(redis.exceptions.NoPermissionError) as info:
        client.execute_command(*command)
    return str(info.value)


def _script_refused(client: redis.Redis, script: str) -> None:
    """A Lua script runs as its caller: a command on a key outside the caller's patterns
    fails inside the script."""
    with pytest.raises(redis.ResponseError, match="can't access"):
        client.eval(script, 0)


def test_a_batch_runs_end_to_end_with_the_least_privilege_users(acl_server, admin,
                                                                 acl_worker, sim_url):
    admin.acl_log_reset()
    url = acl_server.url("submitter")
    task = ('Agent {i}.\n@sim tool shout {{"text": "t{m}"}}\n'
            '@sim tool stamp {{"key": "k{i}"}}')
    handle = submit_batch(task, [{"i": i, "m": i % 3} for i in range(AGENTS)], model="m",
                          backend=sim_url, redis_url=url, tools=[shout, stamp],
                          output_schema=Answer)
    results = handle.wait(timeout=120)
    assert [r.index for r in results] == list(range(AGENTS))
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    assert all({c.name for c in r.tool_calls} == {"shout", "stamp"} for r in results), \
        [(r.turns, [c.name for c in r.tool_calls]) for r in results[:2]]
    assert handle.status()["delivered"] == AGENTS

    # `agentbatch status` from another machine, as the submitter
    env = {**os.environ, "AGENTBATCH_REDIS_URL": url}
    out = subprocess.run([sys.executable, "-m", "agentbatch.cli", "status", handle.batch_id],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "delivered" in out.stdout, (out.stdout, out.stderr)

    # a cancelled batch ends with every agent cancelled or done, and is deleted after
    second = submit_batch("Agent {i}.", [{"i": i} for i in range(AGENTS)], model="m",
                          backend=sim_url, redis_url=url)
    second.cancel()
    ended = second.wait(timeout=120)
    assert len(ended) == AGENTS
    assert all(r.ok or r.error.kind == "cancelled" for r in ended), \
        [r.error for r in ended if not r.ok][:3]
    # nothing on the way was refused: the rules cover every command agentbatch sends
    assert _denials(admin) == []
    with pytest.raises(ConfigError, match="operators' Redis user"):
        handle.delete()  # deleting is the operators' (issue 21, item 9)
    assert {e["object"] for e in _denials(admin)} == {"srem"}
    admin.acl_log_reset()
    assert delete_batch(admin, second.batch_id) > 0
    assert delete_batch(admin, handle.batch_id) > 0
    # only the tombstone that tells a later reader why it is gone stays
    assert admin.keys(f"ab:{{{handle.batch_id}}}:*") == [BatchKeys(handle.batch_id).gone]

    # nothing on the way was refused: the rules cover every command agentbatch sends
    assert _denials(admin) == []
    users = {c["user"] for c in admin.client_list()}
    assert "agentbatch-worker" in users, users
    assert "Connected to redis://agentbatch-worker:**@" in acl_worker.log()


def test_flower_watches_the_fleet_as_the_flower_user(acl_server, admin, acl_worker, sim_url):
    admin.acl_log_reset()
    user, password = "ops", secrets.token_hex(8)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWER_")}
    env.update(AGENTBATCH_REDIS_URL=acl_server.url("flower"),
               FLOWER_BASIC_AUTH=f"{user}:{password}")
    log = Path(tempfile.mkstemp(prefix="agentbatch-flower-acl-", suffix=".log")[1])
    with log.open("wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "agentbatch.cli", "flower", "--port",
                                 str(port)], env=env, cwd=REPO, stdout=sink,
                                stderr=subprocess.STDOUT)
    try:
        base, auth = f"http://127.0.0.1:{port}", (user, password)
        workers: dict[str, Any] = {}
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:  # the worker answers Flower's inspect (pidbox)
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                reply = httpx.get(f"{base}/api/workers", params={"refresh": "1"}, auth=auth,
                                  timeout=30)
                workers = reply.json() if reply.status_code == 200 else {}
            except httpx.HTTPError:
                workers = {}
            if any(name.startswith("aclw-") and info.get("active_queues")
                   for name, info in workers.items()):
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"no worker seen by Flower: {workers}\n"
                                 f"{_denials(admin)}\n{log.read_text()[-3000:]}")
        lengths = httpx.get(f"{base}/api/queues/length", auth=auth, timeout=30)
        assert lengths.status_code == 200
        assert {q["name"] for q in lengths.json()["active_queues"]} == {"inference", "tools"}
        # task events reach Flower over the event channel the flower user may read
        handle = submit_batch("Agent {i}.", [{"i": i} for i in range(3)], model="m",
                              backend=sim_url, redis_url=acl_server.url("submitter"))
        assert all(r.ok for r in handle.wait(timeout=120))
        seen: set[int] = set()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and seen != {0, 1, 2}:
            tasks = httpx.get(f"{base}/api/tasks", params={"taskname": "agentbatch.turn"},
                              auth=auth, timeout=30).json()
            # Flower shows a task's args as the worker names them: batch=<id> agent=<i> ...
            seen = {int(dict(p.split("=", 1) for p in t["args"].split())["agent"])
                    for t in tasks.values() if handle.batch_id in t["args"]}
            time.sleep(0.5)
        assert seen == {0, 1, 2}, log.read_text()[-3000:]
        assert _denials(admin) == []
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(15)
        log.unlink(missing_ok=True)


ADMIN_COMMANDS: list[tuple[Any, ...]] = [
    ("FLUSHALL",), ("FLUSHDB",), ("CONFIG", "SET", "appendonly", "no"),
    ("CONFIG", "GET", "requirepass"), ("KEYS", "*"), ("ACL", "LIST"),
    ("CLIENT", "KILL", "TYPE", "normal"), ("CLIENT", "LIST"), ("SHUTDOWN", "NOSAVE"),
    ("SCRIPT", "FLUSH"), ("REPLICAOF", "127.0.0.1", "1"), ("SAVE",), ("MODULE", "LIST"),
]


@pytest.mark.parametrize("role", ROLES)
def test_no_role_but_the_operators_has_admin_commands(acl_server, role):
    client = _client(acl_server, role)
    for command in ADMIN_COMMANDS:
        _refused(client, *command)
    assert client.ping()


def test_what_the_submitter_is_refused(acl_server, admin):
    admin.set("other:secret", "s3")
    client = _client(acl_server, "submitter")
    probe = "inference.acl-probe"  # a list no worker consumes, under the queues' pattern
    assert client.lpush(probe, "msg") == 1  # it may enqueue...
    _refused(client, "LRANGE", probe, 0, -1)  # ...but never read or take tasks
    _refused(client, "RPOP", "inference")
    _refused(client, "BRPOP", queue_key("tools", 9), 1)
    _refused(client, "HGETALL", "unacked")  # messages in flight on the workers
    _refused(client, "GET", "other:secret")  # keys outside agentbatch's
    _refused(client, "SET", "other:secret", "x")
    _refused(client, "SMEMBERS", "_kombu.binding.celery.pidbox")
    _refused(client, "SUBSCRIBE", "ab:tool:done")  # no pub/sub at all
    _refused(client, "PUBLISH", "/0.celery.pidbox", "{}")  # no remote control of workers
    # a script runs as its caller: it cannot reach past the key rules either
    _refused(client, "EVAL", "return redis.call('GET', KEYS[1])", 1, "other:secret")
    _script_refused(client, "return redis.call('GET', 'other:secret')")
    _refused(client, "FUNCTION", "FLUSH")
    admin.delete(probe, "other:secret")


def test_what_the_worker_is_refused(acl_server, admin):
    admin.set("other:secret", "s3")
    client = _client(acl_server, "worker")
    _refused(client, "GET", "other:secret")
    _refused(client, "SET", "app:session:1", "x")
    _script_refused(client, "return redis.call('GET', 'other:secret')")
    _refused(client, "PUBLISH", "other-channel", "x")
    _refused(client, "SUBSCRIBE", "__keyspace@0__:*")
    _refused(client, "FUNCTION", "FLUSH")
    probe = "tools.acl-probe"  # a list no worker consumes, under the queues' pattern
    assert client.lpush(probe, "m") == 1 and client.rpop(probe) == "m"
    admin.delete("other:secret")


def test_what_flower_and_keda_are_refused(acl_server, admin):
    batch = BatchKeys("acl-probe")
    admin.set(batch.plan, '{"task": "private prompt"}')
    probe = "inference.acl-probe"  # a list no worker consumes, under the queues' pattern
    admin.delete(probe)
    admin.lpush(probe, "m")
    flower = _client(acl_server, "flower")
    assert flower.llen(probe) == 1
    _refused(flower, "GET", batch.plan)  # no prompts, states or results
    _refused(flower, "XRANGE", batch.results, "-", "+")
    _refused(flower, "LPUSH", "inference", "forged task")
    _refused(flower, "RPOP", "inference")
    keda = _client(acl_server, "keda")
    assert keda.llen(probe) == 1 and keda.llen(queue_key("inference", 3)) == 0
    _refused(keda, "GET", batch.plan)
    _refused(keda, "LPUSH", "inference", "x")
    _refused(keda, "LRANGE", "inference", 0, -1)
    _refused(keda, "SUBSCRIBE", "/0.celeryev/*")
    admin.delete(batch.plan, probe)


def test_a_wrong_password_or_the_default_user_without_one_is_refused(acl_server):
    with pytest.raises(redis.AuthenticationError):
        redis.from_url(acl_server.url("worker", password="wrong")).ping()
    with pytest.raises(redis.exceptions.RedisError):  # no anonymous access
        redis.from_url(f"redis://127.0.0.1:{acl_server.port}/0").get("ab:batches")


def _clear(admin: redis.Redis, k: BatchKeys) -> None:
    """Delete every key of the batch ``k``, its tombstone included."""
    keys = list(admin.scan_iter(match=k.pattern()))
    if keys:
        admin.delete(*keys)


def _a_running_batch(admin: redis.Redis, batch_id: str) -> dict[str, Any]:
    """Another tenant's batch, written by the operator: what each key holds now."""
    k = BatchKeys(batch_id)
    _clear(admin, k)
    admin.set(k.plan, '{"backends": ["http://their-server"]}')
    admin.hset(k.meta, mapping={"total": 1, "delivered": 0, "cancelled": 0, "finished": 0})
    admin.hset(k.state, "0", "1:{}")
    return {"plan": admin.get(k.plan), "state": admin.hgetall(k.state),
            "ttl": [admin.pttl(key) for key in (k.plan, k.meta, k.state)]}


def test_the_submitter_cannot_break_the_queues_or_rewrite_another_batch(acl_server, admin):
    """Issue 21, item 9: push only on the queues; batch keys are created, never rewritten.

    Before: ``SET inference x`` answered OK (every worker then crash-loops on WRONGTYPE),
    DEL/EXPIRE of the queues too, and ``SET ab:{other}:plan`` rewrote another tenant's
    backend URL."""
    client = _client(acl_server, "submitter")
    probe = "tools.acl-probe"  # a list no worker consumes, under the queues' pattern
    admin.delete("inference", probe)
    admin.lpush(probe, "queued message")
    for command in (("SET", "inference", "x"), ("SET", probe, "x"), ("DEL", probe),
                    ("UNLINK", probe), ("EXPIRE", probe, 1), ("EXPIRE", "tools", 1),
                    ("PEXPIRE", queue_key("inference", 3), 1), ("RENAME", probe, "inference"),
                    ("LTRIM", probe, 1, 0), ("LSET", probe, 0, "forged"), ("RPOP", probe)):
        _refused(client, *command)
    assert admin.lrange(probe, 0, -1) == ["queued message"] and admin.type("inference") == "none"
    assert client.lpush(probe, "m") == 2  # pushing is all it may do
    admin.delete(probe)

    other = BatchKeys("acl-other")
    before = _a_running_batch(admin, other.batch_id)
    for command in (("SET", other.plan, '{"backends": ["http://attacker"]}'),
                    ("HSET", other.state, "0", "2:{}"), ("DEL", other.plan),
                    ("UNLINK", other.state), ("PEXPIRE", other.plan, 1),
                    ("PERSIST", other.plan), ("RENAME", other.plan, "ab:stage:x"),
                    ("XADD", other.results, "*", "index", "0")):
        _refused(client, *command)
    with pytest.raises(redis.ResponseError, match="can't access"):  # a script runs as its caller
        client.eval("return redis.call('SET', KEYS[1], 'x')", 1, other.plan)
    # the one write that reaches a batch's keys creates them and never replaces one
    client.set("ab:stage:acl-probe:plan", '{"backends": ["http://attacker"]}')
    assert client.renamenx("ab:stage:acl-probe:plan", other.plan) is False
    client.unlink("ab:stage:acl-probe:plan")
    after = {"plan": admin.get(other.plan), "state": admin.hgetall(other.state),
             "ttl": [admin.pttl(key) for key in (other.plan, other.meta, other.state)]}
    assert after == before
    _clear(admin, other)


def test_a_submit_never_overwrites_an_existing_batch(acl_server, admin, sim_url):
    """Submitting under another batch's id is refused and leaves that batch as it was, even
    when it is running (its plan there) or half-written (only its state)."""
    url = acl_server.url("submitter")
    for present in ("plan", "state", "meta"):
        other = BatchKeys(f"acl-taken-{present}")
        _clear(admin, other)
        admin.set(getattr(other, present), "theirs") if present == "plan" else \
            admin.hset(getattr(other, present), "0", "theirs")
        with pytest.raises(BatchSpecError, match="already exists"):
            submit_batch("Agent {i}.", [{"i": 0}], model="m", backend=sim_url, redis_url=url,
                         batch_id=other.batch_id)
        assert [key for key in admin.scan_iter(f"ab:{{{other.batch_id}}}:*")] == \
            [getattr(other, present)]
        assert admin.keys("ab:stage:*") == []
        admin.delete(getattr(other, present))


def test_the_worker_user_cannot_shut_down_the_fleet(acl_server, admin):
    """Issue 21, item 14: stolen worker credentials must not reach Celery's remote control
    (a broadcast ``shutdown`` stops every worker). Workers still answer it, and the flower
    user (the operator's console) still inspects them.

    Before: the broadcast went out and the worker it named shut down."""
    worker = WorkerProcess(acl_server.url("worker"), name="aclctl", concurrency=1)
    try:
        worker.start()
        name = _worker_name(worker)
        with pytest.raises(OperationalError, match="no permissions"):  # kombu's NOPERM
            client_app(acl_server.url("worker")).control.broadcast(
                "shutdown", destination=[name])
        _refused(_client(acl_server, "worker"), "PUBLISH", "/0.celery.pidbox", "{}")
        replies: list[Any] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not replies:  # pidbox consumer may lag start
            replies = client_app(acl_server.url("flower")).control.inspect(
                destination=[name], timeout=5).ping() or []
        assert replies == {name: {"ok": "pong"}}, worker.log()[-2000:]
        assert worker.alive
    finally:
        worker.stop(timeout=15)
        worker.log_path.unlink(missing_ok=True)



def _worker_name(worker: WorkerProcess) -> str:
    """The node name ``WorkerProcess`` gives the worker (``--hostname NAME-pid@%h``)."""
    return f"{worker.name}-{os.getpid()}@{socket.gethostname()}"


def test_the_submitter_creates_a_pipeline_spec_only_if_absent(acl_server, admin):
    """start_pipeline's writes: the spec is staged, then RENAMENX'd into place (never over
    another pipeline's); a direct SET of a pipeline key is refused."""
    pk = PipelineKeys("acl-pipe")
    admin.delete(pk.spec)
    client = _client(acl_server, "submitter")
    staged = pk.staged_spec("t1")
    assert client.set(staged, "{}", px=60_000)
    assert client.renamenx(staged, pk.spec)
    assert client.set(pk.staged_spec("t2"), "{other}", px=60_000)
    assert not client.renamenx(pk.staged_spec("t2"), pk.spec)  # exists: left as it was
    assert admin.get(pk.spec) == b"{}" or admin.get(pk.spec) == "{}"
    _refused(client, "SET", pk.spec, "x")
    _refused(client, "SET", pk.done, "x")
    _refused(client, "DEL", pk.spec)
    admin.delete(pk.spec, pk.staged_spec("t2"))
