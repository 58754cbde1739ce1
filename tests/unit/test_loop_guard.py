"""The loop guard: which streamed JSON replies it stops, and which it never does."""

from __future__ import annotations

import pytest

from agentbatch.backends.loop_guard import LoopGuard, ends_in_loop

# Replies of SmolLM2-135M on llama-server (the tools workload of bench_engine, issue 9), each
# generated to the 96-token limit.
RUNAWAYS = [
    '{"tool_calls":[{"name":"price","arguments":{"item":"toaster_1009_ticket_1009_ticket_1009'
    '_ticket_1009_ticket_1009_ticket_1009_ticket_1009_ticket_1009_ticket_100',
    '{"tool_calls":[{"name":"price","arguments":{"item":"the_item_name_123456789012345678901'
    '234567890123456789012345678901234567890123456789',
    '{"tool_calls":[{"name":"price","arguments":{"item":"the item\'s name.description.type.'
    'description.description.description.description.description.description.d',
    '{"tool_calls":[{"name":"price","arguments":{"item":"the_mix_1015_150_150_150_150_150_150_'
    '150_150_150_150_150_150_150_150_150_150_',
    '{"tool_calls":[{"name":"price","arguments":{"item":"the_mix_item_1011_1111_1111_1111_1111'
    '_1111_1111_1111_1111_1111_1111_1111_1111_11',
]
# Replies of the same runs that ended on their own.
FINE = [
    '{"tool_calls":[{"name":"price","arguments":{"item":"the mixer"}}]}',
    '{"final":{"item":"toaster_1017","price":"12.00000000000000012.00000000000000012.0"}}',
    '{"final":{"item":"the_item","price":"the_item_price_2000000000000000000000000"}}',
    '{"final":{"item":"the item [...]","price":"the item\'s price. 200 ms; 200 ms; 200 ms"}}',
]


def _stops_at(reply: str, piece: int = 3) -> int | None:
    """The length of ``reply`` fed (in ``piece``-character pieces) when the guard trips."""
    guard = LoopGuard()
    for end in range(piece, len(reply) + piece, piece):
        if guard.feed(reply[end - piece:end]):
            return min(end, len(reply))
    return None


@pytest.mark.parametrize("reply", RUNAWAYS)
def test_the_runaways_seen_on_the_real_engine_are_stopped_early(reply: str) -> None:
    stopped = _stops_at(reply)
    assert stopped is not None and stopped < len(reply) - 20, (stopped, len(reply))


@pytest.mark.parametrize("reply", FINE)
def test_replies_that_ended_on_their_own_are_never_stopped(reply: str) -> None:
    assert _stops_at(reply) is None
    assert _stops_at(reply, piece=1) is None


def test_only_text_inside_a_json_string_counts() -> None:
    # a list of equal items is the schema's business (maxItems), not a loop
    assert _stops_at('{"scores": [' + "0, " * 60 + "0]}") is None
    assert _stops_at('{"rows": [' + '{"a": 1}, ' * 30 + "]}") is None
    # the same repetition inside a string is
    assert _stops_at('{"note": "' + "0, " * 60) is not None
    # each string starts afresh: equal short strings one after another never add up
    assert _stops_at('{"a": [' + '"ab", ' * 40 + "]}") is None


def test_escaped_quotes_stay_inside_the_string() -> None:
    assert _stops_at('{"q": "' + '\\"x' * 20) is not None
    assert _stops_at('{"q": "say \\"hi\\" to them", "r": "ok"}') is None


def test_ends_in_loop_needs_both_repeats_and_length() -> None:
    assert ends_in_loop("ab" * 16)  # 32 characters, 16 repeats
    assert not ends_in_loop("ab" * 15)  # 30 characters
    assert ends_in_loop("x" + "abcdefghijklmnop" * 4)  # a 16-character unit, 4 times
    assert not ends_in_loop("abcdefghijklmnopq" * 3)  # 17 characters: longer than max_unit
    assert not ends_in_loop("a perfectly ordinary sentence that goes on for a while")
