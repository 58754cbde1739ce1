"""Provider batch sizes (``Router.pick_size``, ``split_chunks``'s caps): a turn the deadline
presses goes in a small provider batch, which a provider that ends a batch with its slowest
request (the simulator) finishes sooner, rather than to the sync API at twice the price.
Decisions given what the router observed: no I/O, no sleeps, a fixed router clock."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from agentbatch.turnloop.batch_routing import MIN_SIZE_SAMPLES, WINDOW_S, Router
from agentbatch.turnloop.batch_turns import split_chunks
from tests.support.routing_seen import seen_sizes

NOW = 1000.0


def _auto(deadline: float, *, small: int = 6) -> Router:
    """An ``"auto"`` router that has seen the sync and provider batch latencies of
    ``seen_sizes`` (``small`` of each small size)."""
    router = Router("auto", deadline, total=100, clock=lambda: NOW, concurrency=8)
    seen_sizes(router, small)
    return router


def test_the_sizes_are_max_items_halved_down_to_min_items() -> None:
    router = _auto(NOW + 100.0)
    assert router.sizes() == [8, 4, 2, 1]
    router.max_items, router.min_items = 1000, 100  # Bedrock's per-job minimum
    assert router.sizes() == [1000, 500, 250, 125]


def test_a_turn_with_room_goes_in_a_full_batch() -> None:
    router = _auto(NOW + 100.0)
    size, estimate = router.pick_size(2)
    assert size == 8
    assert 8.0 + WINDOW_S <= estimate <= 10.0 + WINDOW_S


def test_a_pressed_last_turn_goes_in_a_small_batch_not_to_the_sync_api() -> None:
    # 6 s left: an 8-, 4- or 2-turn batch (p90 ~10, ~7, ~5.5 s) would not surely answer in
    # the 5 s before the margin, a 1-turn one (p90 ~4 s) would. Before sizes were told
    # apart, the estimate of every batch seen (median ~8 s) sent it to the sync API.
    router = _auto(NOW + 6.0)
    assert router.pick_size(1)[0] == 1
    assert router.decide(1, 100) == ("batch", "routed_batch", 1)
    assert router.stats["routed_batch_small"] == 1
    assert router.stats["routed_sync_deadline"] == 0


def test_too_few_small_batches_seen_are_not_trusted_nor_learnt_by_a_pressed_turn() -> None:
    # 4 of each small size seen, 1 short: a pressed turn is not sized by them, and is not
    # sent to learn them either (late, it would pay the sync price too): the sync API
    router = _auto(NOW + 6.0, small=MIN_SIZE_SAMPLES - 1)
    assert router.pick_size(1)[0] == 8
    assert router.decide(1, 100) == ("sync", "routed_sync_deadline", 8)
    assert router.stats["routed_batch_explore"] == 0


def test_the_first_turns_with_room_learn_the_small_sizes() -> None:
    # sizes unknown: the first turns routed to the batch API, with room (no hedge), go in
    # small batches, MIN_SIZE_SAMPLES per size; after that, full ones again
    router = _auto(NOW + 100.0, small=0)
    sizes = [router.decide(2, 100)[2] for _ in range(3 * MIN_SIZE_SAMPLES + 2)]
    assert sizes == ([1] * MIN_SIZE_SAMPLES + [2] * MIN_SIZE_SAMPLES + [4] * MIN_SIZE_SAMPLES
                     + [8, 8])
    assert router.stats["routed_batch_explore"] == 3 * MIN_SIZE_SAMPLES
    assert router.stats["routed_sync_deadline"] == 0


def test_no_size_fits_the_deadline_the_fastest_is_weighed_against_sync() -> None:
    router = _auto(NOW + 2.0)  # not even a 1-turn batch answers in 1 s
    size, estimate = router.pick_size(1)
    assert size == 1 and estimate < 4.0 + WINDOW_S
    assert router.route(1, 100) == "sync"


@pytest.mark.parametrize("mode", ["batch", "no deadline"])
def test_without_a_deadline_batches_stay_full(mode: str) -> None:
    router = _auto(NOW + 6.0)
    if mode == "batch":
        router.mode = "batch"
    else:
        router.deadline = None
    assert router.pick_size(1)[0] == 8


def test_caps_make_small_batches_and_no_turn_waits_in_one_bigger_than_its_cap() -> None:
    caps = [8, 1, 2, 8, 2, 8, 1, 2]
    turns = list(enumerate(caps))
    chunks, short = split_chunks(turns, SimpleNamespace(max_items=8, min_items=1),
                                 cap_of=lambda turn: turn[1])
    assert short == []
    assert sorted(i for chunk in chunks for i, _ in chunk) == list(range(len(caps)))
    for chunk in chunks:
        assert all(len(chunk) <= cap for _, cap in chunk)
    assert [len(chunk) for chunk in chunks] == [1, 1, 2, 2, 2]


def test_caps_below_the_providers_minimum_are_raised_to_it() -> None:
    turns = [(i, 1) for i in range(6)]
    chunks, short = split_chunks(turns, SimpleNamespace(max_items=8, min_items=3),
                                 cap_of=lambda turn: turn[1])
    assert [len(chunk) for chunk in chunks] == [3, 3] and short == []


def test_without_caps_the_chunks_are_as_before() -> None:
    turns = list(range(19))
    client = SimpleNamespace(max_items=8, min_items=1)
    assert split_chunks(turns, client) == split_chunks(turns, client, cap_of=lambda _: 8)
    assert [len(c) for c in split_chunks(turns, client)[0]] == [8, 8, 3]


def test_the_cached_band_count_follows_every_add() -> None:
    router = _auto(NOW + 6.0, small=0)
    latencies = router.batch_latency
    assert latencies.count(1, 1) == 0 and latencies.count(5, 8) == 20
    for i in range(MIN_SIZE_SAMPLES):
        latencies.add(3.0 + i / 10, 1)
        assert latencies.count(1, 1) == i + 1 == len(latencies.of_size(1, 1))
    assert router.pick_size(1)[0] == 1  # the new one-turn batches size the pressed turn
