"""Poison queue messages: refuse them where they are read, dead-letter them, keep consuming.

Celery 5.7 / kombu 5.7 stop the whole worker on several kinds of bad queue item (the cases:
docs/design-notes.md). Two guards, both installed only in worker processes by
:class:`Consumer` (Celery's ``worker_consumer`` setting): ``check_raw`` on each raw item in
the channel's BRPOP read, before kombu builds a message (not JSON, not an envelope,
compressed: agentbatch never compresses), and a check in the consumer's task handler of the
protocol-2 contract, plus :class:`GuardedMessage`'s catch-all for anything else Celery raises
while accepting a message. A refused message goes to the dead-letter list, is logged once,
and is acked; the worker goes on. Connection and channel errors still propagate.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
from collections.abc import Callable
from queue import Empty
from typing import Any

from celery.worker.consumer import Consumer as CeleryConsumer
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.encoding import bytes_to_str
from vine import promise

from agentbatch.distributed.workers import dead_letters

log = logging.getLogger(__name__)

MAX_ITEM_BYTES = 4 * 1024 * 1024  # agentbatch's messages are ~1 KB; refuse, never parse, more


class PoisonMessage(ValueError):
    """A queue item that can never become a task; ``str()`` says why."""


class UnbuildableMessage(PoisonMessage):
    """kombu raised while building a message from an item :func:`check_raw` passed."""


class GuardedMessage(virtual.Message):
    """kombu's virtual message, with anything its build raises turned into a dead letter.

    :func:`check_raw` checks what is known to trip the build; this catches what is not (it
    does no I/O, so no connection error can come from here).
    """

    def __init__(self, payload: Any, channel: Any = None, **kwargs: Any) -> None:
        try:
            super().__init__(payload, channel=channel, **kwargs)
        except Exception as exc:
            raise UnbuildableMessage(
                f"kombu could not build a message: {type(exc).__name__}: {exc}") from exc


def check_raw(item: bytes | str) -> dict[str, Any]:
    """The kombu envelope in a raw Redis list item, or :class:`PoisonMessage`.

    Checks exactly what ``kombu.transport.virtual.Message`` would trip on, and refuses any
    ``compression`` header so nothing is ever inflated.
    """
    if len(item) > MAX_ITEM_BYTES:
        raise PoisonMessage(f"item of {len(item)} bytes exceeds {MAX_ITEM_BYTES}")
    try:
        payload = json.loads(bytes_to_str(item))
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise PoisonMessage(f"not JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise PoisonMessage(f"not a kombu envelope: a JSON {type(payload).__name__}")
    props = payload.get("properties")
    if not isinstance(props, dict) or "delivery_tag" not in props:
        raise PoisonMessage("not a kombu envelope: no properties.delivery_tag")
    if not isinstance(props["delivery_tag"], str | int) or isinstance(props["delivery_tag"], bool):
        raise PoisonMessage("not a kombu envelope: properties.delivery_tag is a "
                            f"{type(props['delivery_tag']).__name__}, not a string")
    info = props.get("delivery_info")
    if not isinstance(info, dict) or not all(k in info for k in ("exchange", "routing_key")):
        raise PoisonMessage("not a kombu envelope: properties.delivery_info is not a mapping"
                            " with exchange and routing_key")
    encoding = props.get("body_encoding")
    if encoding is not None and not (isinstance(encoding, str) and (
            encoding.lower() == "utf-8" or encoding in kombu_redis.Channel.codecs)):
        raise PoisonMessage(f"unknown body_encoding {encoding!r} (kombu knows utf-8 and"
                            f" {', '.join(kombu_redis.Channel.codecs)})")
    headers = payload.get("headers")
    if headers is not None and not isinstance(headers, dict):
        raise PoisonMessage("not a kombu envelope: headers is not a mapping")
    if headers and headers.get("compression"):
        raise PoisonMessage(f"compressed body refused (compression={headers['compression']!r};"
                            " agentbatch never compresses, so it is never inflated)")
    body = payload.get("body")
    if body is not None and not isinstance(body, str):
        raise PoisonMessage(f"not a kombu envelope: body is a {type(body).__name__}")
    if body and props.get("body_encoding") == "base64":
        try:
            base64.b64decode(body, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise PoisonMessage(f"body is not valid base64: {exc}") from None
    return payload


def task_problem(message: Any) -> str | None:
    """Why a kombu message is not a Celery protocol-2 task, or None if it is one.

    ``message.decode()`` caches the body, so Celery's own request reuses this decode.
    """
    headers = message.headers
    if not isinstance(headers, dict):
        return "headers are not a mapping"
    for name in ("task", "id"):
        if not isinstance(headers.get(name), str):
            return f"not a Celery protocol-2 task: header {name!r} missing or not a string"
    try:
        body = message.decode()
    except Exception as exc:  # DecodeError, ContentDisallowed, anything a decoder raises
        return f"body does not decode: {type(exc).__name__}: {exc}"
    if not (isinstance(body, list | tuple) and len(body) == 3
            and isinstance(body[0], list | tuple) and isinstance(body[1], dict)
            and isinstance(body[2], dict)):
        shown = repr(body)
        return f"protocol-2 body must be [args, kwargs, embed], got {shown[:200]}"
    return None


def _dead_letter(client: Any, queue: str, raw: bytes | str, reason: str) -> None:
    letter = dead_letters.record(queue, raw, reason)
    dead_letters.push(client, letter)
    log.error("dead-letter %s: a message on queue %r was refused (%s); moved to the "
              "dead-letter list (see `agentbatch dead-letters ls`)", letter["id"], queue, reason)


def _guarded_brpop_read(self: Any, **options: Any) -> bool:
    """kombu 5.7's ``Channel._brpop_read`` with :func:`check_raw` before delivery. (``self``
    is a ``kombu_redis.Channel``; the private parts used here are not in celery-types.)"""
    try:
        try:
            dest__item = self.client.parse_response(self.client.connection, "BRPOP", **options)
        except self.connection_errors:
            self.client.connection.disconnect()
            raise
        if not dest__item:
            raise Empty()
        dest, item = dest__item
        dest = bytes_to_str(dest).rsplit(self.sep, 1)[0]
        self._queue_cycle.rotate(dest)
        try:
            payload = check_raw(item)
            self.connection._deliver(payload, dest)  # builds a GuardedMessage
        except PoisonMessage as exc:  # check_raw's, or the build's UnbuildableMessage
            with self.conn_or_acquire() as client:
                _dead_letter(client, dest, item, str(exc))
        return True
    finally:
        self._in_poll = None
        flush = getattr(self, "_flush_brpop_reauth", None)  # kombu 5.7: see its docstring
        if flush is not None:
            flush()


def install_channel_guard() -> None:
    """Check raw items in every kombu Redis channel this process creates from now on.

    The channel binds ``handlers['BRPOP']`` when it is created, so this must run before the
    worker connects (``Consumer.__init__`` does it).
    """
    kombu_redis.Channel._brpop_read = _guarded_brpop_read  # type: ignore[attr-defined]  # private
    kombu_redis.Channel.Message = GuardedMessage


class Consumer(CeleryConsumer):
    """Celery's consumer with poison messages dead-lettered instead of stopping the worker."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        install_channel_guard()
        super().__init__(*args, **kwargs)

    def create_task_handler(self, promise: Any = promise) -> Callable[[Any], Any]:
        handle = super().create_task_handler(promise)
        # (set by Celery's Connection bootstep; not in celery-types)
        passthrough = (tuple(self.connection_errors)  # type: ignore[attr-defined]
                       + tuple(self.channel_errors))  # type: ignore[attr-defined]

        def on_task_received(message: Any) -> Any:
            problem = task_problem(message)
            if problem is None:
                try:
                    return handle(message)
                except passthrough:
                    raise  # Celery reconnects on these
                except Exception as exc:
                    if message.acknowledged:
                        log.exception("error after a message was acked; continuing")
                        return None
                    problem = f"Celery could not accept it: {type(exc).__name__}: {exc}"
            self.dead_letter(message, problem)
            return None

        return on_task_received

    def dead_letter(self, message: Any, reason: str) -> None:
        """Move ``message`` to the dead-letter list, then ack it (so kombu never restores it)."""
        raw = getattr(message, "_raw", None)
        text = json.dumps(raw, default=repr) if raw is not None else repr(message.body)
        queue = (message.delivery_info or {}).get("routing_key") or "?"
        with message.channel.conn_or_acquire() as client:
            _dead_letter(client, queue, text, reason)
        message.ack()
