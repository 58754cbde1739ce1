"""One agent transition, as ``BatchStore.commit`` writes it (``lua/commit.lua``).

The worker decides a transition (``old`` → ``new``, what to enqueue, which lease and slot it
held); the store turns it into one compare-and-set script call. Gathered here so a caller
names each part instead of passing a dozen keyword arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agentbatch.core.agent_state import AgentState

DEFAULT_RETENTION_S = 7 * 24 * 3600.0  # AGENTBATCH_RETENTION_S (distributed/workers/settings.py)


@dataclass(frozen=True)
class Transition:
    """``old`` → ``new`` for one agent, and what the same atomic step does besides."""

    old: AgentState  # what this worker loaded: its version is the compare-and-set's
    new: AgentState
    token: str = ""  # the lease held for the turn ('' = none): released, won or lost
    slot_key: str = ""  # the semaphore zset whose slot the lease token holds ('' = none)
    result_json: str = ""  # a terminal ``new``: the result appended to the results stream
    deadline_ms: int = 0  # a non-terminal ``new``: when the sweep first looks at it
    audit: bool = False  # append (index, version) to the batch's audit stream
    enqueue: Sequence[tuple[str, str]] = ()  # (queue list key, task message) pushed on success
    retention_s: float = DEFAULT_RETENTION_S  # only for a batch submitted without one
    listed: int | None = None  # of ``old.messages``, how many are in the msgs list (None: all)
    consumed: Sequence[str] = ()  # keys the transition uses up (fan-in hash, call locks)
    # a terminal ``new`` keeps its conversation (msgs list, retention TTL) for the result's
    # ``messages`` and ``agentbatch show``: keep_transcript, or it failed (finish.py)
    keep_transcript: bool = False
    # (queue list key, task message) pushed only if this commit finishes the batch
    on_finish: tuple[str, str] | None = None
    # what ``new``'s usage adds to the batch's spend at its prices (US dollars; None: the
    # batch has no prices): added to meta's ``spend`` only if this commit wins, with the
    # model replies ``new`` adds, so a turn that runs twice is paid into it once
    spend_usd: float | None = None
