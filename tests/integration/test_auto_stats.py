"""The distributed provider-batch counters (``distributed/provider_batches.py``) on a real
redis-server: routing and hedge counts go through the worker's background ``BatchStats`` (a
burst of them is one transaction, never one ``note`` round trip each), and a submission's two
counts are one round trip, on the batch before the provider is asked. Commands are counted
with MONITOR, never timed."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from agentbatch.core.agent_state import AgentState
from agentbatch.core.plan import BatchPlan
from agentbatch.distributed.provider_batches import ProviderBatches, _Turn, redis_clock
from agentbatch.distributed.state.connection import async_client
from agentbatch.distributed.state.keys import BatchKeys
from agentbatch.distributed.state.redis_store import BatchStore, sync_clock
from agentbatch.distributed.state.scripts import Scripts
from agentbatch.distributed.workers.batch_stats import BatchStats
from tests.support.redis_monitor import MonitorRecorder
from tests.support.routing_seen import seen_sizes

pytestmark = [pytest.mark.redis]

N = 20
MAX_TURNS = 3


def _plan(batch_id: str, total: int = N) -> BatchPlan:
    return BatchPlan(batch_id=batch_id, total=total, model="m", backends=["sim://127.0.0.1:1"],
                     system_message="", max_turns=MAX_TURNS, pricing="auto",
                     deadline_at=redis_clock() + 600.0)


def _names(seen: MonitorRecorder) -> list[bytes]:
    return [c[0].upper() for c in seen.commands if c]


def _stat_evals(seen: MonitorRecorder) -> list[int]:
    """Where in the MONITOR log each ``note`` of a ``stat:`` field ran."""
    return [i for i, c in enumerate(seen.commands)
            if c and c[0].upper() == b"EVALSHA" and any(a.startswith(b"stat:") for a in c)]


def test_a_burst_of_routed_turns_is_counted_in_one_transaction_without_note(
        redis_url: str) -> None:
    notes: list[tuple[str, str, int]] = []

    async def note(batch_id: str, what: str, n: int = 1) -> None:
        notes.append((batch_id, what, n))

    async def scenario() -> tuple[dict[str, str], MonitorRecorder]:
        client = async_client(redis_url)
        await sync_clock(client, force=True)
        scripts = Scripts(client)
        stats = BatchStats(client, scripts, flush_s=3600)  # only ``settle`` writes here
        batches = ProviderBatches(note, stats)
        plan, store = _plan("burst"), BatchStore(client, scripts, "burst")
        # one agent live: every agent on its last turn is at the batch's tail
        await client.hset(store.k.meta, mapping={"total": N, "delivered": N - 1})
        states = [AgentState(index=i, input={}, turns=MAX_TURNS - 1) for i in range(N)]
        with MonitorRecorder(redis_url) as seen:
            routes = await asyncio.gather(*(batches.route(plan, store, s) for s in states))
            await stats.settle()
        assert routes == ["sync"] * N  # the probe, then the tail
        meta = {str(k): str(v) for k, v in (await client.hgetall(store.k.meta)).items()}
        await client.aclose()
        return meta, seen

    meta, seen = asyncio.run(scenario())
    assert notes == []  # not one ``note`` round trip per routed turn
    assert meta["stat:routed_sync_probe"] == "1"
    assert meta["stat:routed_sync_tail"] == str(N - 1)
    # gathered: each flush is one transaction with one note per field; before, one note
    # round trip per turn. How many flushes the 20 routes make depends on how their Redis
    # replies spread over passes of the loop, so their number is not asserted here; that the
    # routes settling in one pass share one flush is, below.
    evals, names = _stat_evals(seen), _names(seen)
    assert all(_in_transaction(names, i) for i in evals), names
    for fields in _fields_per_transaction(seen):
        assert len(fields) == len(set(fields)), fields


def test_settles_asked_in_one_pass_of_the_loop_share_one_flush(redis_url: str) -> None:
    async def scenario() -> tuple[dict[str, str], MonitorRecorder]:
        client = async_client(redis_url)
        stats = BatchStats(client, Scripts(client), flush_s=3600)  # only ``settle`` writes
        await client.hset(BatchKeys("pass").meta, "total", N)
        with MonitorRecorder(redis_url) as seen:
            settles = []
            for i in range(N):  # N routed turns counted and settled with no await between
                stats.add("pass", "routed_sync_tail" if i else "routed_sync_probe")
                settles.append(stats.settle())
            await asyncio.gather(*settles)
        meta = {str(k): str(v) for k, v in (await client.hgetall(BatchKeys("pass").meta)).items()}
        await client.aclose()
        return meta, seen

    meta, seen = asyncio.run(scenario())
    assert meta["stat:routed_sync_probe"] == "1"
    assert meta["stat:routed_sync_tail"] == str(N - 1)
    assert _names(seen).count(b"MULTI") == 1, _names(seen)
    assert _fields_per_transaction(seen) == [[b"stat:routed_sync_probe",
                                              b"stat:routed_sync_tail"]]


def _fields_per_transaction(seen: MonitorRecorder) -> list[list[bytes]]:
    """The ``stat:`` fields noted in each MULTI ... EXEC, in order."""
    out: list[list[bytes]] = []
    for c in seen.commands:
        if c and c[0].upper() == b"MULTI":
            out.append([])
        elif c and c[0].upper() == b"EVALSHA" and out:
            out[-1] += [a for a in c if a.startswith(b"stat:")]
    return out


def _in_transaction(names: list[bytes], at: int) -> bool:
    before = names[:at]
    return b"MULTI" in before and (b"EXEC" not in before
                                   or before[::-1].index(b"MULTI") < before[::-1].index(b"EXEC"))


class _Provider:
    """A provider batch client that takes any submit and never ends a batch."""

    min_items = 1
    max_items = 1000

    def __init__(self) -> None:
        self.submitted: list[list[str]] = []

    async def submit(self, items: list[tuple[str, Any]]) -> Any:
        self.submitted.append([cid for cid, _ in items])
        return SimpleNamespace(id=f"pb{len(self.submitted)}")

    async def state(self, batch_id: str) -> Any:
        return SimpleNamespace(ended=False, status="in_progress")


def test_a_submission_is_counted_for_each_batch_in_one_round_trip_before_it_is_sent(
        redis_url: str) -> None:
    notes: list[tuple[str, str, int]] = []
    sizes = {"a": 3, "b": 2}

    async def note(batch_id: str, what: str, n: int = 1) -> None:
        notes.append((batch_id, what, n))

    async def scenario() -> tuple[dict[str, dict[str, str]], MonitorRecorder, _Provider]:
        client = async_client(redis_url)
        await sync_clock(client, force=True)
        scripts = Scripts(client)
        batches = ProviderBatches(note, BatchStats(client, scripts, flush_s=3600))
        provider = _Provider()
        loop = asyncio.get_running_loop()
        chunk = []
        for batch_id, n in sizes.items():
            store = BatchStore(client, scripts, batch_id)
            await client.hset(store.k.meta, "total", n)
            chunk += [(f"{batch_id}-{i}", _Turn(store, i, 0, None, loop.create_future()))  # type: ignore[arg-type]
                      for i in range(n)]
        with MonitorRecorder(redis_url) as seen:
            await batches._submit(provider, chunk)  # type: ignore[arg-type]
        metas = {b: {str(k): str(v) for k, v in
                     (await client.hgetall(BatchKeys(b).meta)).items()} for b in sizes}
        for task in list(batches._tasks):
            task.cancel()
        await asyncio.gather(*batches._tasks, return_exceptions=True)
        await client.aclose()
        return metas, seen, provider

    metas, seen, provider = asyncio.run(scenario())
    assert len(provider.submitted) == 1 and notes == []
    for batch_id, n in sizes.items():  # on the batch at once: readers compare right away
        assert metas[batch_id]["stat:provider_batches"] == "1"
        assert metas[batch_id]["stat:provider_batch_items"] == str(n)
    names = _names(seen)
    evals = _stat_evals(seen)
    assert len(evals) == 4, seen.commands
    # all four in one transaction: one round trip
    assert names.count(b"MULTI") == 1, names
    multi, exec_ = names.index(b"MULTI"), names.index(b"EXEC")
    assert all(multi < i < exec_ for i in evals), names


@pytest.mark.parametrize(("deadline_s", "small", "expect"), [
    (6.0, 6, {"stat:routed_batch_small": "1"}),  # pressed: a 1-turn batch, sizes known
    (600.0, 0, {"stat:routed_batch_small": "1", "stat:routed_batch_explore": "1"}),  # learns
    (600.0, 6, {}),  # room, sizes known: a full batch, nothing to count
])
def test_a_turn_sized_below_the_maximum_is_counted_on_the_batch(
        redis_url: str, deadline_s: float, small: int, expect: dict[str, str]) -> None:
    """On the distributed engine the small and learning batches were counted only in each
    worker's router, not on the batch (``stat:``), so no reader of the batch saw them."""
    async def scenario() -> tuple[tuple[str, int | None], dict[str, str]]:
        client = async_client(redis_url)
        await sync_clock(client, force=True)
        scripts = Scripts(client)
        stats = BatchStats(client, scripts, flush_s=3600)
        batches = ProviderBatches(_quiet, stats)
        bid = f"sized-{deadline_s:g}-{small}"
        plan = BatchPlan(batch_id=bid, total=100, model="m",
                         backends=["sim://127.0.0.1:1"], system_message="",
                         max_turns=MAX_TURNS, pricing="auto",
                         deadline_at=redis_clock() + deadline_s)
        store = BatchStore(client, scripts, bid)
        await client.hset(store.k.meta, mapping={"total": 100, "delivered": 0})
        router = await batches.router_for(plan, store)
        router.max_items, router.min_items = 8, 1
        seen_sizes(router, small)
        route = await batches.route_sized(plan, store,
                                          AgentState(index=0, input={}, turns=MAX_TURNS - 1))
        await stats.settle()
        meta = {str(k): str(v) for k, v in (await client.hgetall(store.k.meta)).items()
                if str(k).startswith("stat:routed_batch")}
        await client.aclose()
        return route, meta

    (where, size), meta = asyncio.run(scenario())
    assert where == "batch"
    assert (size < 8) == bool(expect)
    assert meta == expect


async def _quiet(batch_id: str, what: str, n: int = 1) -> None:
    return None
