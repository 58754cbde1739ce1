"""The message at a task queue's consuming end, as the recovery sweep reads it.

Every task message carries the time it was sent (``SENT_HEADER``, Redis's clock in ms,
stamped by ``workers.envelope``). A queue's lists are FIFO, so the sent time of the message
about to be consumed says how far the queue has got: a never-started agent whose message was
sent well after it has been passed by (its message is lost), one sent before or about with it
is still queued behind. Comparing the head's id between two looks says whether the queue
moves at all. ``defer.lua`` decides from both, for a whole batch in one script call.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

SENT_HEADER = "ab_sent_ms"
"""Header of every agentbatch task message: when it was sent (ms, Redis's clock)."""


@dataclass(frozen=True)
class QueueHead:
    """The messages at the consuming end of a queue's lists (``sent_ms`` None: the queue is
    empty, or a message there carries no stamp: nothing known)."""

    sent_ms: int | None = None
    message_id: str = ""

    @property
    def args(self) -> tuple[str, str]:
        """``defer.lua``'s two arguments for this queue ('' = unknown)."""
        if self.sent_ms is None or not self.message_id:
            return "", ""
        return str(self.sent_ms), self.message_id


NO_HEAD = QueueHead()


def head_of(payloads: list[bytes | str | None]) -> QueueHead:
    """The head of a queue from the message at the consuming end of each of its priority
    lists (None: an empty list), unknown if any of them carries no stamp. The sweep does not
    know which list an agent's message is on, so both answers are for the queue as a whole:
    ``sent_ms`` is the earliest head's (past it, every list has moved past the agent), and
    ``message_id`` names all the heads (it changes when any list moves: a starved
    low-priority list must not make a queue whose other lists move look still)."""
    heads: list[tuple[int, str]] = []
    for raw in payloads:
        if raw is None:
            continue
        try:
            message = json.loads(raw)
            headers = message["headers"]
            heads.append((int(headers[SENT_HEADER]), str(headers["id"])))
        except (ValueError, TypeError, KeyError):  # not ours, or sent before the stamp
            return NO_HEAD
    if not heads:
        return NO_HEAD
    if len(heads) == 1:
        return QueueHead(heads[0][0], heads[0][1])
    names = hashlib.sha1(",".join(i for _, i in heads).encode()).hexdigest()[:16]
    return QueueHead(min(sent for sent, _ in heads), names)
