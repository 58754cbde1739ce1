"""Notice a Celery consumer that stopped consuming, and restart this worker in place.

After a broker reconnect, a Celery worker on Redis can stay connected yet never fetch again
(celery#8030, #10205, #10302). *Stalled* means: this worker has a free slot (Celery's own
``reserved_requests``), its queues hold messages, and nothing has reached it for ``stall_s``
since it first saw them waiting (or since its last receipt, if later). A stalled worker
re-executes itself (same pid, same argv): Celery's warm shutdown first, then ``os.execv``
from an ``atexit`` hook, with a backstop after ``HARD_AFTER_S``. Versioned state and the
recovery sweep make the handover safe. What was seen, and why a re-exec rather than a
consumer restart: docs/design-notes.md.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import redis
from celery.platforms import close_open_fds
from celery.worker import state as celery_state

from agentbatch.distributed.workers.app import PRIORITY_STEPS
from agentbatch.distributed.workers.envelope import queue_key

log = logging.getLogger(__name__)

RESTARTS_ENV = "AGENTBATCH_WATCHDOG_RESTARTS"  # carried across re-execs, for the log
HARD_AFTER_S = 30.0  # re-exec anyway if the warm shutdown has not finished by then


def busy_slots() -> int:
    """Requests this worker holds (reserved or running), from Celery's parent-side state."""
    return len(celery_state.reserved_requests | celery_state.active_requests)


class ConsumerWatchdog:
    def __init__(self, queues: Iterable[str], stall_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.lists = [queue_key(q, p) for q in queues for p in PRIORITY_STEPS]
        self.stall_s = stall_s
        self._clock = clock
        self.last_received = clock()
        self.waiting_since: float | None = None

    def received(self) -> None:
        self.last_received = self._clock()

    def observe(self, waiting: int, busy: int, slots: int) -> bool:
        """Record one look at the queues; True once the consumer counts as stalled."""
        now = self._clock()
        if waiting <= 0 or busy >= slots:
            self.waiting_since = None  # nothing to fetch, or no room to fetch it: not stalled
            return False
        if self.waiting_since is None:
            self.waiting_since = now
        return now - max(self.waiting_since, self.last_received) >= self.stall_s

    def waiting(self, client: redis.Redis) -> int:
        """Messages waiting on the first non-empty list, lowest priority first (the list
        most often holding some in a busy fleet): one LLEN per look there, not one per
        list; 0 when all are empty. Only whether any wait matters (``observe``)."""
        for name in reversed(self.lists):
            if n := int(client.llen(name)):
                return n
        return 0

    def stalled(self, client: redis.Redis, slots: int) -> bool:
        busy = busy_slots()
        waiting = self.waiting(client) if busy < slots else 0
        return self.observe(waiting, busy, slots)

    def restart_in_place(self) -> None:
        restarts = int(os.environ.get(RESTARTS_ENV, "0")) + 1
        os.environ[RESTARTS_ENV] = str(restarts)
        log.error("the Celery consumer has fetched nothing for %.0fs while %s hold messages "
                  "and it had free slots (a known Celery/kombu stall after a broker "
                  "reconnect); re-executing this worker in place (restart %d)",
                  self.stall_s, ", ".join(self.lists), restarts)
        reexec_after_shutdown()


_exec_lock = threading.Lock()


def _kill_children() -> None:
    """SIGKILL leftover pool children: after exec nothing would reap or drive them."""
    for children in Path("/proc/self/task").glob("*/children"):
        for pid in children.read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def _exec_self() -> None:
    if not _exec_lock.acquire(blocking=False):
        return  # the other path is already re-executing
    try:
        _kill_children()
    except OSError:
        log.warning("could not list pool children before re-exec", exc_info=True)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    # (celery-types says a set of fds; celery takes files too, through maybe_fileno)
    close_open_fds([sys.__stdin__, sys.__stdout__, sys.__stderr__])  # type: ignore[arg-type]
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


def _backstop() -> None:
    time.sleep(HARD_AFTER_S)
    log.error("warm shutdown did not finish in %.0fs; re-executing now", HARD_AFTER_S)
    _exec_self()


def reexec_after_shutdown() -> None:
    """Warm-stop Celery (SIGTERM), then exec this program again; hard after HARD_AFTER_S."""
    atexit.register(_exec_self)
    threading.Thread(target=_backstop, name="agentbatch-reexec", daemon=True).start()
    os.kill(os.getpid(), signal.SIGTERM)
