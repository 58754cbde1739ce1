"""Exit a worker whose Celery consumer stopped consuming, so its supervisor restarts it.

After a broker reconnect, a Celery worker on Redis can stay connected yet never fetch again
(celery#8030, #10205, #10302). Seen here after a Redis restart: tasks waited on the queue
while both workers sat idle. If this process has free slots and its queues hold messages,
but no task has reached it for ``stall_s``, it logs why and shuts down (warm, then hard);
compose and Kubernetes restart it and the fresh consumer drains the queue. Versioned state
makes the handover safe.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterable

import redis

from .app import PRIORITY_STEPS
from .envelope import queue_key

log = logging.getLogger(__name__)


class ConsumerWatchdog:
    def __init__(self, queues: Iterable[str], stall_s: float) -> None:
        self.lists = [queue_key(q, p) for q in queues for p in PRIORITY_STEPS]
        self.stall_s = stall_s
        self.last_received = time.monotonic()
        self.active = 0
        self._lock = threading.Lock()

    def received(self) -> None:
        self.last_received = time.monotonic()

    def started(self) -> None:
        with self._lock:
            self.active += 1

    def finished(self) -> None:
        with self._lock:
            self.active -= 1

    def stalled(self, client: redis.Redis, slots: int) -> bool:
        if time.monotonic() - self.last_received < self.stall_s or self.active >= slots:
            return False
        with client.pipeline(transaction=False) as pipe:
            for name in self.lists:
                pipe.llen(name)
            waiting = sum(pipe.execute())
        return waiting > 0

    def restart_process(self) -> None:
        log.error("the Celery consumer has fetched nothing for %.0fs while %s hold messages "
                  "(a known Celery/kombu stall after a broker reconnect); exiting so the "
                  "supervisor starts a fresh worker", self.stall_s, ", ".join(self.lists))
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Timer(20.0, lambda: os._exit(1)).start()
