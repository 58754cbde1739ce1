"""The consumer watchdog (issue 11 item 5): it never restarts a healthy worker, and a stalled
consumer recovers without a supervisor (the worker re-executes itself in place, same pid)."""

from __future__ import annotations

import os
import socket
import time

import pytest

from agentbatch import submit_batch
from agentbatch.distributed.workers.app import client_app
from agentbatch.distributed.workers.watchdog import ConsumerWatchdog
from tests.support.tools import Answer, lookup
from tests.support.workers import WorkerProcess

STALL = {"AGENTBATCH_CONSUMER_STALL_S": "2", "AGENTBATCH_WORKER_IMPORTS": "tests.support"}
REEXEC = "re-executing this worker in place"
OLD_EXIT = "exiting so the supervisor"


def _submit(redis_url: str, sim_url: str, n: int):
    return submit_batch('Agent {i}.\n@sim tool lookup {{"key": "w{i}"}}',
                        [{"i": i} for i in range(n)], model="sim-model", backend=sim_url,
                        redis_url=redis_url, output_schema=Answer, tools=[lookup])


def _wait_done(handle, worker: WorkerProcess, timeout: float = 180) -> None:
    """Until the batch finishes; fail at once if the worker process is gone."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if handle.status().get("finished") == 1:
            return
        if not worker.alive:
            raise AssertionError(f"worker exited: {worker.log()[-3000:]}")
        time.sleep(0.5)
    raise AssertionError(f"batch not finished in {timeout}s: {handle.status()}; "
                         f"log: {worker.log()[-3000:]}")


def _assert_never_restarted(worker: WorkerProcess, pid: int) -> None:
    log = worker.log()
    assert worker.alive and worker.proc.pid == pid
    assert REEXEC not in log and OLD_EXIT not in log, log[-3000:]
    assert log.count(" ready.") == 1, log[-3000:]


@pytest.mark.redis
@pytest.mark.slow
def test_busy_prefork_worker_is_not_restarted(redis_url, sim_url, start_workers):
    """Tools run 6 s (3x the stall threshold) in both prefork children while more wait."""
    env = {**STALL, "TEST_TOOL_SLEEP_S": "6", "AGENTBATCH_QUEUE_GRACE_S": "120"}
    (worker,) = start_workers(1, pool="prefork", concurrency=2, env=env)
    pid = worker.proc.pid
    handle = _submit(redis_url, sim_url, 6)
    _wait_done(handle, worker)
    assert all(r.ok for r in handle.wait(timeout=30))
    _assert_never_restarted(worker, pid)


@pytest.mark.redis
@pytest.mark.slow
def test_idle_worker_serves_a_new_batch_without_restarting(redis_url, sim_url, start_workers):
    (worker,) = start_workers(1, concurrency=2, env=STALL)
    pid = worker.proc.pid
    time.sleep(5)  # idle for more than twice the threshold, with nothing on its queues
    for _ in range(3):  # each batch puts 40 messages on the queues of an idle worker
        handle = _submit(redis_url, sim_url, 40)
        _wait_done(handle, worker)
        assert all(r.ok for r in handle.wait(timeout=30))
        time.sleep(3)
    _assert_never_restarted(worker, pid)


@pytest.mark.redis
@pytest.mark.slow
def test_stalled_consumer_recovers_without_a_supervisor(redis_url, sim_url, start_workers):
    """A real stall of the consumer: Celery's own ``cancel_consumer`` control command makes the
    live, connected worker stop fetching from both queues (as after celery#8030). No
    supervisor runs (``supervise=False``): only the worker itself can bring it back."""
    (worker,) = start_workers(1, concurrency=2, env=STALL)
    pid = worker.proc.pid
    node = f"{worker.name}-{os.getpid()}@{socket.gethostname()}"
    control = client_app(redis_url).control
    for queue in ("inference", "tools"):
        # a loaded worker can miss one 10 s reply window; asking again is harmless (Celery
        # answers ok whether or not it was still consuming from the queue)
        deadline, replies = time.monotonic() + 60, []
        while not replies:
            assert time.monotonic() < deadline, f"no reply to cancel_consumer({queue!r})"
            replies = control.cancel_consumer(queue, destination=[node], reply=True,
                                              timeout=10)
        assert "ok" in next(iter(replies[0].values())), replies
    # on a loaded machine a worker can miss one inspect's 10 s reply window: ask again
    deadline, queues = time.monotonic() + 60, None
    while queues != []:
        assert time.monotonic() < deadline, f"the consumer still reports queues: {queues}"
        if queues is not None:
            time.sleep(0.5)
        queues = (control.inspect(destination=[node], timeout=10).active_queues() or {}).get(node)

    handle = _submit(redis_url, sim_url, 5)
    _wait_done(handle, worker)
    assert all(r.ok for r in handle.wait(timeout=30))
    log = worker.log()
    assert worker.alive and worker.proc.pid == pid  # re-executed in place: same process
    assert f"{REEXEC} (restart 1)" in log, log[-3000:]
    assert log.count(" ready.") == 2, log[-3000:]
    assert OLD_EXIT not in log


def test_stall_is_measured_from_when_messages_wait():
    """The decision itself, on a fake clock: idle time before work appears does not count,
    a full worker is never stalled, and any receipt restarts the measurement."""
    now = [0.0]
    dog = ConsumerWatchdog(["inference"], stall_s=10, clock=lambda: now[0])
    now[0] = 1000.0  # idle for a long time
    assert not dog.observe(waiting=0, busy=0, slots=2)
    assert not dog.observe(waiting=5, busy=0, slots=2)  # work appears: the clock starts now
    now[0] = 1009.0
    assert not dog.observe(waiting=5, busy=0, slots=2)
    dog.received()
    now[0] = 1015.0
    assert not dog.observe(waiting=5, busy=1, slots=2)  # 6 s since the last receipt
    now[0] = 1030.0
    assert not dog.observe(waiting=5, busy=2, slots=2)  # full: waiting messages are normal
    now[0] = 1035.0
    assert not dog.observe(waiting=5, busy=1, slots=2)  # a slot frees: measure from here
    now[0] = 1045.0
    assert dog.observe(waiting=5, busy=1, slots=2)  # 10 s waiting, free slot, no receipt
