"""Where a turn goes among a server's slots (llama.cpp's ``id_slot``), and who decides it.

``Placement`` is one decision; ``SlotPlacer`` is a decider a fleet shares: a distributed
worker pins its turns through the fleet's slot map (``distributed/state/slot_map.py``), so
any worker sends an agent's turn to the slot holding its conversation, as the embedded
engine's ``SlotPicker`` (``backends/llamacpp.py``) does within one process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Placement:
    """Where one turn goes: ``send``, the ``id_slot`` sent (None: the server picks), and
    ``slot``, the slot counted busy while it runs (the one sent, or the one the server is
    expected to pick: its idle slot used longest ago)."""

    send: int | None
    slot: int | None

    def ran_on(self, landed: int | None) -> int | None:
        """The slot the turn ran on: the one sent, else the one the server said it picked
        (``landed``), else the one counted."""
        if self.send is not None:
            return self.send
        return landed if landed is not None else self.slot


class SlotPlacer(Protocol):
    """A ``SlotPicker`` kept where every process of a fleet shares it. Both calls are bounded
    and never raise: a placer that cannot answer sends turns unpinned
    (``Placement(None, None)``)."""

    async def acquire(self, agent_key: str, first: bool) -> Placement:
        """``first``: the agent's first turn (no slot can hold its conversation yet)."""
        ...

    async def held(self, agent_key: str) -> Placement | None:
        """The idle slot holding the agent's conversation, counted busy (to save it from),
        or None; given back with ``release(place, agent_key, None)``."""
        ...

    async def claim(self) -> Placement | None:
        """A free slot, counted busy (to restore a conversation into), or None; given back
        with ``release(place, agent_key, None)`` once restored (it then holds the agent's
        conversation), or ``release(place, "", None)`` if not (it then holds nobody's)."""
        ...

    async def release(self, place: Placement, agent_key: str, ran: int | None) -> None:
        """The turn ended; ``ran``: the slot the server said it ran on, if it said."""
        ...
