"""Turn and tool task messages: what to send next for an agent, and sending it."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache

import redis
from celery import Celery

from agentbatch.core.agent_state import AgentState
from agentbatch.core.turns import CallModel, RunTools, TurnPolicy, next_action
from agentbatch.distributed.state.connection import broker_client_url, sync_client
from agentbatch.distributed.state.redis_store import now_ms
from agentbatch.distributed.workers.app import (
    INFERENCE_QUEUE,
    PRIORITY_STEPS,
    TOOL_TASK,
    TOOLS_QUEUE,
    TURN_TASK,
    priority_for,
)
from agentbatch.distributed.workers.envelope import envelope


@dataclass(frozen=True)
class Followup:
    """One task to enqueue. Its args are readable in Flower: batch, agent, version, turn."""

    task: str
    args: tuple[object, ...]
    queue: str
    priority: int
    countdown: float | None = None  # seconds before a worker may run it (Celery ETA)


def turn_message(batch_id: str, state: AgentState, turns_left: int) -> Followup:
    return Followup(TURN_TASK, (batch_id, state.index, state.version, state.steps + 1),
                    INFERENCE_QUEUE, priority_for(turns_left))


def turn_again(batch_id: str, index: int, version: int, after_ms: int) -> Followup:
    """The same turn once more, due when a busy lease would have run out."""
    return Followup(TURN_TASK, (batch_id, index, version, 0), INFERENCE_QUEUE,
                    PRIORITY_STEPS[0], countdown=after_ms / 1000 + 0.05)


def tool_again(batch_id: str, index: int, version: int, call_id: str, tool: str, calls: int,
               after_ms: int) -> Followup:
    """The same tool call once more, due when the lock another delivery holds would have run
    out (``tool_start.lua``)."""
    return Followup(TOOL_TASK, (batch_id, index, version, call_id, tool, calls), TOOLS_QUEUE,
                    PRIORITY_STEPS[0], countdown=after_ms / 1000 + 0.05)


def followups_for(batch_id: str, policy: TurnPolicy, state: AgentState,
                  skip_calls: Iterable[str] = ()) -> list[Followup]:
    """The tasks that move ``state`` forward (none when it has ended)."""
    action = next_action(policy, state)
    if isinstance(action, CallModel):
        return [turn_message(batch_id, state, action.turns_left)]
    if isinstance(action, RunTools):
        skip = set(skip_calls)
        priority = priority_for(policy.max_turns - state.steps)
        calls = len(action.calls)  # the round's size: a round of one has no fan-in to read
        return [
            Followup(TOOL_TASK, (batch_id, state.index, state.version, call.id, call.name, calls),
                     TOOLS_QUEUE, priority)
            for call in action.calls if call.id not in skip
        ]
    return []


SENT_KEY = "ab_sent_ms"
"""A task message's top-level field (kombu ignores it): when it was sent, by Redis's clock
(``now_ms``). The recovery sweep reads it off the oldest message of a list to tell how far
the list has moved (``sweep.py``); 0 means "says nothing" (a re-send jumps the queue)."""
_SENT = re.compile(r'\{"' + SENT_KEY + r'":(\d+),')


def envelopes(app: Celery, followups: list[Followup],
              sent_ms: int | None = None) -> list[tuple[str, str]]:
    """(list key, payload) per task, each stamped with ``sent_ms`` (default: now). A stamp
    is taken before the message is pushed, so it is never later than its push."""
    stamp = '{"' + SENT_KEY + f'":{now_ms() if sent_ms is None else sent_ms},'
    out = []
    for f in followups:
        key, payload = envelope(app, f.task, list(f.args), f.queue, f.priority,
                                countdown=f.countdown)
        out.append((key, stamp + payload[1:]))  # payload: a JSON object, '{"body": ...'
    return out


def sent_ms_of(payload: str | bytes | None) -> int:
    """A message's ``SENT_KEY`` stamp; 0 for a message without one (sent by anything else,
    or handed back by kombu, which rewrites it)."""
    if payload is None:
        return 0
    text = payload.decode(errors="replace") if isinstance(payload, bytes) else payload
    m = _SENT.match(text)
    return int(m.group(1)) if m else 0


@cache
def _broker_client(url: str, tls: tuple[tuple[str, object], ...] = ()) -> redis.Redis:
    return sync_client(url, **dict(tls))


def broker_client(app: Celery) -> redis.Redis:
    """A sync client to the broker Redis (shared per URL), with the broker's TLS options:
    ``broker_url`` carries none (``ssl_ca_certs`` & co. move to ``broker_use_ssl``), and
    without them a private CA's certificate fails verification."""
    tls = tuple(sorted((app.conf.broker_use_ssl or {}).items()))
    # sentinel: kombu's broker_url lists the sentinels; the primary's name is a transport option
    return _broker_client(broker_client_url(app.conf.broker_url,
                                            app.conf.broker_transport_options), tls)


def publish(app: Celery, followups: list[Followup]) -> None:
    """LPUSH the task messages in one pipeline (kombu's own format, see ``envelope``)."""
    if not followups:
        return
    with broker_client(app).pipeline(transaction=False) as pipe:
        for key, payload in envelopes(app, followups):
            pipe.lpush(key, payload)
        pipe.execute()
