"""The Celery tasks. Thin: run the async step on the process loop, then send follow-ups.

A task never raises for an agent's failure (that is a result with a structured error). If it
raises at all (Redis unreachable mid-turn), it is acked and logged, and the recovery sweep
re-sends the agent's work once its progress deadline passes.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import Task, signals

from agentbatch.distributed.workers import kombu_client_cache, loop, oom
from agentbatch.distributed.workers.app import PIPELINE_TASK, SWEEP_TASK, TOOL_TASK, TURN_TASK, app
from agentbatch.distributed.workers.context import worker_context
from agentbatch.distributed.workers.dispatch import broker_client, publish
from agentbatch.distributed.workers.steps import run_tool, run_turn
from agentbatch.distributed.workers.sweep import sweep_once
from agentbatch.distributed.workers.watchdog import ConsumerWatchdog

log = logging.getLogger(__name__)
kombu_client_cache.install()


@app.task(name=TURN_TASK, bind=True)
def turn_task(self: Task[Any, Any], batch_id: str, index: int, version: int, turn: int = 0) -> None:
    """One model turn of agent ``index`` at ``version`` (``turn`` is for people reading Flower)."""
    followups = loop.run(run_turn(worker_context(), batch_id, index, version))
    publish(self.app, followups)


@app.task(name=TOOL_TASK, bind=True)
def tool_task(self: Task[Any, Any], batch_id: str, index: int, version: int, call_id: str,
              tool: str = "", calls: int = 0) -> None:
    """One tool call of agent ``index`` at ``version`` (``tool`` names it, for Flower too;
    ``calls`` is the round's size, 0 when unknown)."""
    followups = loop.run(run_tool(worker_context(), batch_id, index, version, call_id, tool,
                                  calls))
    publish(self.app, followups)


@app.task(name=PIPELINE_TASK, bind=True)
def pipeline_task(self: Task[Any, Any], pipeline: str, stage: int) -> str:
    """Stage ``stage`` of a chained pipeline finished (its last commit sent this): submit the
    next stage once, or end the pipeline (``patterns/pipeline_chain.py``)."""
    from agentbatch.patterns.pipeline_chain import stage_finished

    settings = worker_context().settings
    return stage_finished(settings.redis_url, settings.worker_imports, pipeline, stage)


@app.task(name=SWEEP_TASK, bind=True)
def sweep_task(self: Task[Any, Any]) -> int:
    """Run one recovery sweep now (the workers also sweep on a timer)."""
    return loop.run(sweep_once(worker_context()))


class Sweeper(threading.Thread):
    """Runs the sweep every ``sweep_interval_s`` in each worker (a Redis lock lets one act),
    and checks that this worker's consumer still consumes."""

    def __init__(self, watchdog: ConsumerWatchdog | None, slots: int) -> None:
        super().__init__(name="agentbatch-sweeper", daemon=True)
        self.stop = threading.Event()
        self.watchdog = watchdog
        self.slots = slots

    def run(self) -> None:
        interval = worker_context().settings.sweep_interval_s
        while not self.stop.wait(interval):
            oom.watch.check(worker_context().settings.redis_url)  # only while Redis is full
            try:
                loop.run(sweep_once(worker_context(), periodic=True), timeout=120)
            except Exception:
                log.warning("recovery sweep failed; will retry", exc_info=True)
            try:  # apart from the sweep: a failing sweep must not switch the watchdog off
                if self.watchdog and self.watchdog.stalled(broker_client(app), self.slots):
                    self.watchdog.restart_in_place()
                    return
            except Exception:
                log.warning("consumer watchdog check failed; will retry", exc_info=True)


_sweeper: Sweeper | None = None
_watchdog: ConsumerWatchdog | None = None


@signals.worker_ready.connect
def _start_sweeper(sender: object = None, **_: object) -> None:
    global _sweeper, _watchdog
    oom.install()  # Redis out of memory: one clear error in the log, not a loop
    consumer = getattr(sender, "consumer", None) or sender
    queues = [q.name for q in getattr(getattr(consumer, "task_consumer", None), "queues", [])]
    slots = getattr(getattr(consumer, "pool", None), "limit", None) or 1
    stall_s = worker_context().settings.consumer_stall_s
    _watchdog = ConsumerWatchdog(queues, stall_s) if queues and stall_s > 0 else None
    _sweeper = Sweeper(_watchdog, slots)
    _sweeper.start()


@signals.task_received.connect
def _on_received(**_: object) -> None:
    """Sent by the consumer in the parent process for every pool (prerun is the child's)."""
    if _watchdog is not None:
        _watchdog.received()


@signals.worker_shutting_down.connect
def _stop_sweeper(**_: object) -> None:
    if _sweeper is not None:
        _sweeper.stop.set()
