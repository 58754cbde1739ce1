"""The Celery app: JSON only, late acks, one reserved task per slot, two routed queues.

Every setting here is chosen for agent turns (seconds long, IO-bound, redeliverable) and is
checked against Celery 5.7 / kombu 5.7; see shared CELERY_NOTES.md.
"""

from __future__ import annotations

import logging
import os
from functools import cache
from typing import Any

from celery import Celery, signals
from kombu import Queue

from agentbatch.distributed.state.connection import broker_ssl, broker_transport, broker_url

INFERENCE_QUEUE = "inference"
TOOLS_QUEUE = "tools"
TURN_TASK = "agentbatch.turn"
TOOL_TASK = "agentbatch.tool"
SWEEP_TASK = "agentbatch.sweep"
PIPELINE_TASK = "agentbatch.pipeline_stage"  # a pipeline stage finished: submit the next
PRIORITY_STEPS = [0, 3, 6, 9]  # kombu's default; each step is its own Redis list


def celery_config(redis_url: str) -> dict[str, Any]:
    transport = {
        "queue_order_strategy": "priority",  # near-done agents first (0 is highest)
        "priority_steps": PRIORITY_STEPS,
        # No ack emulation: kombu would copy every delivered message into an ``unacked``
        # hash and zset and delete it again on ack (eight Redis commands per task) only to
        # redeliver it an hour later. Leases, the progress deadlines and the sweep own
        # recovery: a message a dead worker took is re-sent once its agent's deadline passes
        # (distributed/workers/sweep.py), and a worker's warm shutdown hands back what it
        # prefetched.
        "ack_emulation": False,
        "health_check_interval": 10,  # celery#8030: notice dead broker connections
        "socket_timeout": 30,
        "socket_connect_timeout": 10,
        "socket_keepalive": True,
        "retry_on_timeout": True,
        **broker_transport(redis_url),  # sentinel://: the primary's name (master_name)
    }
    return {
        # one reading of the URL for broker and state: unix sockets, verified TLS
        "broker_url": broker_url(redis_url),
        "broker_use_ssl": broker_ssl(redis_url),
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],  # never pickle: it runs code on load
        "event_serializer": "json",
        "task_ignore_result": True,  # results travel on our Redis stream
        "result_backend": None,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_acks_on_failure": True,  # a raising task is a bug; the sweep recovers its agent
        "worker_prefetch_multiplier": 1,
        "worker_disable_prefetch": False,
        "task_queues": [Queue(INFERENCE_QUEUE), Queue(TOOLS_QUEUE)],
        "task_default_queue": INFERENCE_QUEUE,
        "task_routes": {
            TURN_TASK: {"queue": INFERENCE_QUEUE},
            TOOL_TASK: {"queue": TOOLS_QUEUE},
            SWEEP_TASK: {"queue": INFERENCE_QUEUE},
        },
        "task_default_priority": 9,
        "broker_transport_options": transport,
        "broker_connection_retry_on_startup": True,
        "broker_channel_error_retry": True,
        "broker_pool_limit": 64,
        "worker_send_task_events": True,  # Flower
        # Tasks are enqueued by our own pipelined LPUSH (see envelope.py), which emits no
        # task-sent event; Flower shows each task from the moment a worker receives it.
        "task_send_sent_event": False,
        "worker_hijack_root_logger": False,
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        # poison messages dead-lettered, task events batched (distributed/workers/consumer.py)
        "worker_consumer": "agentbatch.distributed.workers.consumer:Consumer",
    }


def make_app(redis_url: str) -> Celery:
    app = Celery("agentbatch", set_as_current=False)
    app.conf.update(celery_config(redis_url))
    app.on_after_finalize.connect(_only_agentbatch_tasks, weak=False)
    return app


def _only_agentbatch_tasks(sender: Celery, **_: Any) -> None:
    """Unregister Celery's built-in ``celery.*`` tasks (chord_unlock, map, accumulate, ...).

    Anyone who can LPUSH to a queue could otherwise make workers run them; we use none, so a
    worker accepts only ``agentbatch.*`` tasks and discards any other as unregistered."""
    registry = sender._tasks  # type: ignore[attr-defined]  # private; celery-types omits it
    for name in [n for n in registry if not n.startswith("agentbatch.")]:
        registry.unregister(name)


# Celery's loggers of the two INFO lines it writes per task ("received", "succeeded in").
PER_TASK_LOGGERS = ("celery.worker.strategy", "celery.app.trace")


@signals.after_setup_logger.connect
def _per_task_lines_at_debug_only(loglevel: int | str | None = None, **_: Any) -> None:
    """Below DEBUG, a worker does not log two lines for every task: at thousands of turns a
    second that is log volume nobody reads and ~5% of an inference worker's CPU (yappi).
    Flower shows every task; errors and retries are still logged (WARNING and up)."""
    level = logging.getLevelName(loglevel.upper()) if isinstance(loglevel, str) else loglevel
    if isinstance(level, int) and level > logging.DEBUG:
        for name in PER_TASK_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)


@cache
def client_app(redis_url: str) -> Celery:
    """A sending-only app per URL for submitters (tasks are sent by name)."""
    return make_app(redis_url)


def priority_for(turns_left: int) -> int:
    """Fewer turns left → higher priority (lower number)."""
    return PRIORITY_STEPS[min(max(turns_left, 1), len(PRIORITY_STEPS)) - 1]


app = make_app(os.environ.get("AGENTBATCH_REDIS_URL", "redis://127.0.0.1:6379/0"))
