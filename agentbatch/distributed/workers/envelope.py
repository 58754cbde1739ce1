"""Celery task messages built locally, for pushing to Redis in bulk or inside a script.

Celery's ``send_task`` costs about 1 ms of CPU and one round trip per message. Here the same
envelope kombu's Redis transport would LPUSH is built with Celery's own protocol-2 message
factory and kombu's serializer, so thousands of tasks go out in one pipeline, and the commit
script can enqueue an agent's next task atomically with its state write.
"""

from __future__ import annotations

import base64
import json
import uuid
from bisect import bisect

from celery import Celery
from kombu.serialization import dumps
from kombu.transport.redis import Channel

from agentbatch.distributed.workers.app import PRIORITY_STEPS, TOOL_TASK, TURN_TASK

SEP = Channel.sep  # kombu's separator between a queue name and its priority step
# What each positional arg means, for the ``argsrepr`` Flower shows in place of the args
# (``agentbatch.turn batch=... agent=29 turn=2 version=2``); the worker still reads ``args``.
ARG_NAMES = {TURN_TASK: ("batch", "agent", "version", "turn"),
             TOOL_TASK: ("batch", "agent", "version", "call", "tool", "calls")}
SHOWN_FIRST = ("batch", "agent", "turn", "tool")  # what a person looks for, leftmost


def args_repr(task: str, args: list[object]) -> str:
    """``name=value`` per arg of an agentbatch task (JSON for any other task), so a row in
    Flower reads without the source: which batch, which agent, which turn or tool."""
    names = ARG_NAMES.get(task)
    if names is None or len(args) > len(names):
        return json.dumps(args)
    pairs = dict(zip(names, args, strict=False))  # fewer args: older messages, defaults
    order = [n for n in SHOWN_FIRST if n in pairs] + [n for n in pairs if n not in SHOWN_FIRST]
    return " ".join(f"{name}={pairs[name]}" for name in order)


def queue_key(queue: str, priority: int) -> str:
    """The Redis list kombu reads for ``queue`` at ``priority`` (as ``Channel._q_for_pri``)."""
    step = PRIORITY_STEPS[bisect(PRIORITY_STEPS, priority) - 1]
    return f"{queue}{SEP}{step}" if step else queue


def envelope(app: Celery, task: str, args: list[object], queue: str,
             priority: int, countdown: float | None = None) -> tuple[str, str]:
    """(Redis list key, JSON payload) for one task message; ``countdown`` delays it."""
    task_id = str(uuid.uuid4())
    # (celery-types says args is a tuple; any sequence serializes to the same JSON list)
    message = app.amqp.as_task_v2(task_id, task, args=args, kwargs={},  # type: ignore[arg-type]
                                  countdown=countdown, argsrepr=args_repr(task, args),
                                  kwargsrepr="{}")
    content_type, content_encoding, body = dumps(message.body, serializer="json")
    raw = body.encode(content_encoding or "utf-8") if isinstance(body, str) else body
    payload = {
        "body": base64.b64encode(raw).decode(),
        "content-encoding": content_encoding,
        "content-type": content_type,
        "headers": message.headers,
        "properties": {
            **message.properties,
            "delivery_mode": 2,
            "delivery_info": {"exchange": "", "routing_key": queue},
            "priority": priority,
            "body_encoding": "base64",
            "delivery_tag": str(uuid.uuid4()),
        },
    }
    return queue_key(queue, priority), json.dumps(payload)
