"""A distributed batch's progress, read from what Redis already holds (no script writes it).

Cost of one snapshot, whatever the batch's size:

- ``HGETALL meta``: ``n:awaiting_tools`` (the commit script's counter), ``finished`` and
  the batch's times;
- the results stream from this reader's cursor on (``XRANGE``, 500 entries a call): each
  result is read once per reader, for done, failed by kind and the tokens;
- one ``MGET`` per 1,000 live agents of their lease keys (a lease is a model turn in flight):
  at 10,000 live agents, 10 commands and about 350 KB of reply;
- the recovery check of ``status()`` (``resends``), empty unless the sweep re-sent agents.

Tokens are the finished agents' (from their results): a live agent's usage is in its state
entry, and reading 10,000 state entries a second is not a cheap snapshot. The spend is live:
meta's ``spend`` and ``replies``, which every winning commit adds to (``lua/commit.lua``),
so ``cost_usd`` counts running agents' turns too. The plan is read once per reader (its
prices, caps and ``max_turns``) for the projection to the end (``budget.WorkEstimate``'s
estimate, from the results read here) and its warning past ``max_cost_usd``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import redis

from agentbatch.core.plan import BatchPlan
from agentbatch.distributed.state.keys import BatchKeys
from agentbatch.distributed.state.replies import range_entries, str_values
from agentbatch.turnloop.progress import BatchProgress, Throughput, TokenCounts, eta, slowest

log = logging.getLogger(__name__)

_XRANGE_COUNT = 500
_MGET_CHUNK = 1000


class DistributedProgress:
    """Reads one distributed batch's progress; keeps a cursor and running totals, so
    successive snapshots read only what changed in the results stream."""

    def __init__(self, client: redis.Redis, batch_id: str, total: int,
                 recovering: Callable[[], int]) -> None:
        self.client = client
        self.keys = BatchKeys(batch_id)
        self.batch_id = batch_id
        self.total = total
        self._recovering = recovering
        self._cursor = "-"
        self._seen = bytearray(total)  # agents whose result this reader has read
        self._kinds: dict[str, int] = {}
        self._tokens = [0, 0, 0]
        self._cost: float | None = None  # the finished agents' cost_usd (None: no prices)
        self._ended_turns = 0  # replies of the agents whose result was read
        self._done = 0  # agents that finished ok, and their replies
        self._done_turns = 0
        self._plan: BatchPlan | None = None
        self._plan_read = False
        self._warning: str | None = None  # set once the projection passes max_cost_usd
        self._leases: dict[int, tuple[str, float]] = {}  # index -> (token, first seen)
        self._rate = Throughput()

    def _read_results(self) -> None:
        while True:
            start = self._cursor if self._cursor == "-" else f"({self._cursor}"
            entries = range_entries(self.client.xrange(self.keys.results, min=start, max="+",
                                                       count=_XRANGE_COUNT))
            for entry_id, fields in entries:
                self._cursor = entry_id
                self._count(fields)
            if len(entries) < _XRANGE_COUNT:
                return

    def _count(self, fields: dict[str, str]) -> None:
        try:
            index, result = int(fields["i"]), json.loads(fields["r"])
        except (KeyError, ValueError):
            return
        if not 0 <= index < self.total or self._seen[index]:
            return  # a result written again after a failover: counted once
        self._seen[index] = 1
        usage = result.get("usage") or {}
        for j, name in enumerate(("prompt_tokens", "cached_tokens", "completion_tokens")):
            self._tokens[j] += int(usage.get(name) or 0)
        if isinstance(cost := result.get("cost_usd"), int | float):
            self._cost = (self._cost or 0.0) + cost
        turns = int(result.get("turns") or 0)
        self._ended_turns += turns
        if result.get("ok"):
            self._done += 1
            self._done_turns += turns
        else:
            kind = (result.get("error") or {}).get("kind", "unknown")
            self._kinds[kind] = self._kinds.get(kind, 0) + 1

    def _read_plan(self) -> BatchPlan | None:
        """The batch's plan, read once (None: gone, or not readable here)."""
        if not self._plan_read:
            self._plan_read = True
            try:
                raw = self.client.get(self.keys.plan)
                self._plan = BatchPlan.model_validate_json(raw) if raw else None
            except Exception:  # an unreadable plan costs the projection only
                log.debug("plan of batch %s not readable", self.batch_id, exc_info=True)
        return self._plan

    def _spend(self, meta: dict[str, Any], live: int) -> tuple[float | None, float | None]:
        """(spent, projected) in US dollars: meta's live ``spend`` when the plan has prices
        (else the finished agents' costs, and no projection); the projection is the spend
        plus its mean per reply times the turns left (``budget.WorkEstimate``)."""
        plan = self._read_plan()
        if plan is None or not plan.prices:
            return self._cost, None
        spent = float(meta.get("spend") or 0.0)
        replies = int(meta.get("replies") or 0)
        if not replies:
            return spent, None
        per_agent = self._done_turns / self._done if self._done else float(plan.max_turns)
        live_turns = max(replies - self._ended_turns, 0)
        left = max(live * per_agent - live_turns, float(live))
        projected = spent + spent / replies * left
        cap = plan.max_cost_usd
        if (self._warning is None and cap is not None and math.isfinite(projected)
                and projected > cap):
            self._warning = (f"projected cost ${projected:.4f} passes max_cost_usd={cap:g} "
                             f"(spent ${spent:.4f} over {replies} replies, ~{left:.0f} turns "
                             "left): the cap will end agents budget_exceeded")
            log.warning("batch %s on course to pass its cap: %s", self.batch_id,
                        self._warning)
        return spent, projected

    def _running(self, now: float) -> dict[int, float]:
        """Live agents holding a turn lease -> when this reader first saw that lease."""
        live = [i for i in range(self.total) if not self._seen[i]]
        held: dict[int, tuple[str, float]] = {}
        for at in range(0, len(live), _MGET_CHUNK):
            chunk = live[at:at + _MGET_CHUNK]
            tokens = str_values(self.client.mget([self.keys.lease(i) for i in chunk]))
            for index, token in zip(chunk, tokens, strict=True):
                if token is not None:
                    known = self._leases.get(index)
                    held[index] = known if known and known[0] == token else (token, now)
        self._leases = held
        return {index: since for index, (_, since) in held.items()}

    def snapshot(self, read_meta: Callable[[], dict[str, Any]]) -> BatchProgress:
        """The snapshot. ``read_meta`` reads the batch's ``meta`` hash (the caller owns the
        lost/expired errors); it is read after the results, so an agent counted finished
        from its result is never also counted live from meta's counters."""
        now = time.monotonic()
        self._read_results()
        meta = read_meta()
        finished = meta.get("finished") == "1"
        failed = sum(self._kinds.values())
        ended = sum(self._seen)
        done = ended - failed
        awaiting = max(0, int(meta.get("n:awaiting_tools", 0)))
        live = self.total - ended
        running_since = {} if finished else self._running(now)
        running = min(len(running_since), max(0, live - awaiting))
        awaiting = min(awaiting, live)
        created = float(meta.get("created_at") or 0)
        end = float(meta["finished_at_ms"]) / 1000 if meta.get("finished_at_ms") else time.time()
        elapsed = max(0.0, end - created) if created else 0.0
        throughput = self._rate.rate(ended, elapsed, now)
        spent, projected = self._spend(meta, live)
        return BatchProgress(
            batch_id=self.batch_id, engine="distributed", total=self.total, done=done,
            failed=failed, running=running, awaiting_tools=awaiting,
            queued=live - awaiting - running,
            recovering=0 if finished else self._recovering(), elapsed_s=elapsed,
            finished=finished and live == 0, failed_by_kind=dict(self._kinds),
            tokens=TokenCounts(*self._tokens), cost_usd=spent, projected_cost_usd=projected,
            budget_warning=self._warning, throughput=throughput,
            eta_s=eta(live, throughput), slowest=slowest(running_since, now))
