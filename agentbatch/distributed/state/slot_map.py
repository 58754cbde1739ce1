"""The fleet's slot map of one llama-server: which agent's conversation each slot holds.

The embedded engine pins an agent's turns to the llama.cpp slot holding its conversation
(``backends/llamacpp.py``: ``SlotPicker``), from what its one process saw. A distributed
batch's turns run on any worker, so a picker per process would pin two agents to one slot and
forget where each ran. ``FleetSlots`` makes the same decisions in Redis, one Lua call per turn
start (``lua/slot_take.lua``) and one per end (``lua/slot_give.lua``), on one hash per server
(``keys.slot_map_key``); a carry between servers (``EndpointPool._carry``) saves from the slot
it says holds the agent and restores into one it claims. A worker uses it for the servers whose
warm-up probe at submit found pinning keeps the prefix (``BatchPlan.pinned_slots``). A turn
counted on a slot by a worker that died stops counting at the turn's deadline; Redis that
cannot answer in ``CALL_TIMEOUT_S`` sends the turn unpinned, as without a map.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from redis.exceptions import RedisError

from agentbatch.backends.base import Backend
from agentbatch.backends.setup import endpoints
from agentbatch.backends.slot_placement import Placement
from agentbatch.core.plan import BatchPlan
from agentbatch.core.wait_for import wait_for
from agentbatch.distributed.state.keys import slot_map_key
from agentbatch.distributed.state.scripts import Scripts

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 2.0  # one slot_take / slot_give; past it the turn goes unpinned
IDLE_MS = 60 * 60 * 1000  # the map expires an hour after its server's last turn
UNPINNED = Placement(None, None)
_WARN_EVERY_S = 60.0


class FleetSlots:
    """``SlotPlacer`` for one llama-server (``endpoint``, its name) with ``slots`` slots."""

    def __init__(self, scripts: Scripts, endpoint: str, slots: int, turn_ttl_ms: int) -> None:
        self.scripts = scripts
        self.endpoint = endpoint
        self.key = slot_map_key(endpoint)
        self.slots = slots
        self.turn_ttl_ms = turn_ttl_ms
        self._warned = -_WARN_EVERY_S

    async def acquire(self, agent_key: str, first: bool) -> Placement:
        return await self._take(agent_key, "first" if first else "next") or UNPINNED

    async def held(self, agent_key: str) -> Placement | None:
        return await self._take(agent_key, "held")

    async def claim(self) -> Placement | None:
        return await self._take("", "claim")

    async def _take(self, agent_key: str, mode: str) -> Placement | None:
        """``slot_take.lua`` in ``mode``; None when it placed nothing or did not answer."""
        reply = await self._call(self.scripts.slot_take, [
            agent_key, self.slots, mode, self.turn_ttl_ms, IDLE_MS])
        if not isinstance(reply, list) or len(reply) != 2:
            return None
        send, slot = (int(v) for v in reply)
        if send < 0 and slot < 0:
            return None
        return Placement(send if send >= 0 else None, slot if slot >= 0 else None)

    async def release(self, place: Placement, agent_key: str, ran: int | None) -> None:
        ran = place.ran_on(ran)
        await self._call(self.scripts.slot_give, [
            agent_key, self.slots, -1 if place.slot is None else place.slot,
            -1 if ran is None else ran, IDLE_MS])

    async def _call(self, script: Any, args: list[Any]) -> Any:
        try:
            return await wait_for(script(keys=[self.key], args=args), CALL_TIMEOUT_S)
        except (RedisError, OSError, TimeoutError) as exc:
            now = time.monotonic()
            if now - self._warned >= _WARN_EVERY_S:
                self._warned = now
                log.warning("%s: the fleet's slot map did not answer (%s); turns go unpinned "
                            "meanwhile", self.endpoint, exc)
            return None


def share_fleet_slots(backend: Backend, plan: BatchPlan, scripts: Scripts) -> None:
    """Give each endpoint of ``backend`` that the plan names in ``pinned_slots`` the fleet's
    map of its slots (``Backend.share_slots``)."""
    # a count left by a dead worker lapses at the turn's deadline, a minute at least
    ttl_ms = int(max(plan.timeout_per_turn or 0.0, 60.0) * 1000)
    for endpoint in endpoints(backend):
        slots = plan.pinned_slots.get(endpoint.name)
        if slots:
            endpoint.share_slots(FleetSlots(scripts, endpoint.name, slots, ttl_ms))
