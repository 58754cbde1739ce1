"""The worker's Celery consumer: poison messages dead-lettered, task events sent in batches.

Celery's consumer buffers task events and flushes the buffer on the next loop iteration,
which under load is one Redis ``PUBLISH`` per event: three per task (received, started,
succeeded), a sixth of a turn's Redis commands. Flushing at most every ``EVENT_FLUSH_S``
(or when Celery's 24-event buffer fills) sends them as a few ``task.multi`` messages
instead. Flower and ``celery events`` read those unchanged; they see each event at most
``EVENT_FLUSH_S`` later.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agentbatch.distributed.workers.poison import Consumer as PoisonGuardConsumer

EVENT_FLUSH_S = 0.1


class Consumer(PoisonGuardConsumer):
    """``worker_consumer`` for agentbatch workers (see the module docstring)."""

    _flush_timer: Any = None
    # Celery's consumer sets these; celery-types does not declare them (annotations only).
    hub: Any
    _flush_events: Callable[[], None]

    # (celery-types says this returns a Callable; Celery's own returns None, as this does)
    def on_send_event_buffered(self) -> None:  # type: ignore[override]
        if self.hub is None:
            return
        if self._flush_timer is None:
            self._flush_timer = self.hub.call_later(EVENT_FLUSH_S, self._flush_batched)

    def _flush_batched(self) -> None:
        self._flush_timer = None
        self._flush_events()
