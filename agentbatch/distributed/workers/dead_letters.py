"""The dead-letter list: queue messages no worker could turn into a task, kept for a person.

A malformed message must leave the queue (or it crash-loops every worker that reads it) but
must not vanish silently. Each one becomes a JSON record on the capped Redis list
``DEAD_LETTERS`` (newest first): an id for ``agentbatch dead-letters drop``, the queue it came
from, why it was refused, and the raw item (truncated). Nothing here re-sends a message: the
recovery sweep re-sends lost agent work on its own, so a dead letter is evidence, not a backlog.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import redis

from agentbatch.distributed.state.keys import DEAD_LETTERS
from agentbatch.distributed.state.replies import str_list

MAX_LETTERS = 1000  # the list is trimmed to the newest this many
RAW_KEEP = 64 * 1024  # characters of the raw item kept per letter


def record(queue: str, raw: bytes | str, reason: str) -> dict[str, Any]:
    """The dead-letter record for one raw queue item."""
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
    return {"id": uuid.uuid4().hex[:12], "at": round(time.time(), 3), "queue": queue,
            "reason": reason, "size": len(raw), "truncated": len(text) > RAW_KEEP,
            "raw": text[:RAW_KEEP]}


def push(client: redis.Redis, letter: dict[str, Any]) -> None:
    """Add one letter and trim the list in one transaction (the cap bounds Redis memory)."""
    with client.pipeline(transaction=True) as pipe:
        pipe.lpush(DEAD_LETTERS, json.dumps(letter))
        pipe.ltrim(DEAD_LETTERS, 0, MAX_LETTERS - 1)
        pipe.execute()


def list_letters(client: redis.Redis, limit: int = MAX_LETTERS) -> list[dict[str, Any]]:
    """Newest first; an entry that is not a record (hand-pushed) is shown as raw text."""
    letters = []
    for item in client.lrange(DEAD_LETTERS, 0, max(limit, 1) - 1):
        text = item.decode("utf-8", "replace") if isinstance(item, bytes) else item
        try:
            letter = json.loads(text)
        except ValueError:
            letter = None
        if not isinstance(letter, dict) or "id" not in letter:
            letter = {"id": None, "queue": "?", "reason": "not a dead-letter record",
                      "raw": text}
        letters.append(letter)
    return letters


def drop(client: redis.Redis, letter_id: str) -> bool:
    """Remove the letter with ``letter_id``; False if there is none."""
    for item in str_list(client.lrange(DEAD_LETTERS, 0, -1)):
        try:
            letter = json.loads(item)
        except ValueError:
            continue
        if isinstance(letter, dict) and letter.get("id") == letter_id:
            return bool(client.lrem(DEAD_LETTERS, 1, item))
    return False


def drop_all(client: redis.Redis) -> int:
    """Remove every letter; returns how many there were."""
    with client.pipeline(transaction=True) as pipe:
        pipe.llen(DEAD_LETTERS)
        pipe.delete(DEAD_LETTERS)
        count, _ = pipe.execute()
    return int(count)
