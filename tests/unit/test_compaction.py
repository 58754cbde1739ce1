"""The compaction view's pure functions (``core/compaction.py``), as tables."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from agentbatch.core import compaction as cp
from agentbatch.core.errors import BatchSpecError


def call(cid: str, name: str = "t") -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": "{}"}}


def convo(*outputs: int) -> list[dict]:
    """A task, then one assistant tool call and its result of ``n`` chars per output."""
    messages: list[dict] = [{"role": "user", "content": "task"}]
    for i, n in enumerate(outputs):
        messages.append({"role": "assistant", "content": None, "tool_calls": [call(f"c{i}")]})
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "name": "t",
                         "content": chr(ord("a") + i) * n})
    return messages


def tool_lengths(messages: list[dict]) -> list[int]:
    return [len(m["content"]) for m in messages if m["role"] == "tool"]


@pytest.mark.parametrize(("outputs", "cut", "shortened"), [
    # (outputs' sizes, chars to cut, which outputs end shorter than they were)
    ((1000, 1000, 1000), 500, [True, False, False]),  # the oldest alone is enough
    ((1000, 1000, 1000), 1200, [True, True, False]),  # oldest first (to its head), then the next
    ((1000, 5000), 3000, [True, True]),  # the older one is not enough: the latest is cut too
    ((5000,), 2000, [True]),  # the latest output alone does not fit
    ((300, 5000), 3000, [False, True]),  # shorter than its head plus a marker: left whole
    ((100, 100), 50, [False, False]),  # nothing a marker could shorten
])
def test_truncate_cuts_oldest_first(outputs, cut, shortened) -> None:
    messages = convo(*outputs)
    view, removed = cp.truncate_tool_outputs(messages, cut)
    lengths = tool_lengths(view)
    assert [new < old for new, old in zip(lengths, outputs, strict=True)] == shortened
    assert removed == sum(outputs) - sum(lengths)
    assert removed >= cut if any(shortened) else removed == 0
    assert messages == convo(*outputs)  # the stored history is not touched


def test_truncate_keeps_every_call_paired_and_the_roles_in_order() -> None:
    messages = convo(4000, 4000, 4000)
    view, _ = cp.truncate_tool_outputs(messages, 9000)
    strip = [{k: v for k, v in m.items() if k != "content"} for m in messages]
    assert [{k: v for k, v in m.items() if k != "content"} for m in view] == strip


def test_the_marker_says_what_was_removed() -> None:
    [_, _, out] = cp.truncate_tool_outputs(convo(1000), 600)[0]
    assert out["content"].startswith("a" * 100)
    removed = 1000 - out["content"].index("\n")
    assert f"removed {removed} of 1000 chars" in out["content"]


def test_truncate_is_deterministic_and_grows_monotonically() -> None:
    """The same history and cut give the same bytes (the server's cache can hit them), and a
    bigger cut never changes an older output that the smaller cut had already cut."""
    messages = convo(2000, 2000, 2000)
    small, _ = cp.truncate_tool_outputs(messages, 2500)
    assert small == cp.truncate_tool_outputs(messages, 2500)[0]
    big, _ = cp.truncate_tool_outputs(messages, 3500)
    assert big[2] == small[2]  # the oldest output, cut to its head in both


def test_nothing_left_to_cut_reports_what_was_removed() -> None:
    view, removed = cp.truncate_tool_outputs(convo(50), 10_000)
    assert removed <= 50 and tool_lengths(view)[0] > 0  # a marker at most, never negative


@pytest.mark.parametrize(("roles", "points"), [
    (["user"], []),
    (["user", "assistant", "tool"], []),  # nothing between the task and the first reply
    (["user", "assistant", "tool", "assistant", "tool"], [3]),
    (["user", "assistant", "tool", "assistant", "tool", "assistant"], [3, 5]),
    (["user", "assistant", "user", "assistant"], [3]),  # a repair turn in between
])
def test_summary_points_start_the_tail_at_an_assistant_message(roles, points) -> None:
    assert cp.summary_points([{"role": r, "content": "x"} for r in roles]) == points


def test_summary_view_keeps_the_task_and_the_tail_and_alternates_roles() -> None:
    messages = convo(10, 20, 30)
    view = cp.summary_view(messages, 5, "it read a and b")
    assert view[0]["content"].startswith("task") and "it read a and b" in view[0]["content"]
    assert "4 messages" in view[0]["content"]
    assert view[1:] == messages[5:]
    assert [m["role"] for m in view] == ["user", "assistant", "tool"]


def test_the_summarizer_reads_plain_text_with_the_calls() -> None:
    text = cp.transcript(convo(5))
    assert "[called t({})]" in text and "[tool result t]\naaaaa" in text


@pytest.mark.parametrize(("messages", "tools"), [
    ([{"role": "user", "content": "héllo wörld " * 50}], None),
    (convo(300, 20), [{"type": "function", "function": {"name": "t", "parameters": {}}}]),
])
def test_the_bound_is_above_the_estimate_and_any_byte_tokenizer(messages, tools) -> None:
    bound = cp.token_upper_bound(messages, tools)
    assert bound >= len(json.dumps(messages, ensure_ascii=False).encode())
    assert bound >= cp.estimate_tokens(messages, tools)


@pytest.mark.parametrize(("compaction", "threshold", "error"), [
    ("truncate", 0.8, None),
    ("summarize", 1, None),
    (None, 0.5, None),
    ("shorten", 0.8, "compaction must be one of 'truncate', 'summarize' or None"),
    ("truncate", 0, "compaction_threshold must be a number in (0, 1]"),
    ("truncate", 1.01, "compaction_threshold"),
    ("truncate", float("nan"), "compaction_threshold"),
    ("truncate", True, "compaction_threshold"),
    ("truncate", "0.5", "compaction_threshold"),
])
def test_check_compaction(compaction, threshold, error) -> None:
    if error is None:
        cp.check_compaction(compaction, threshold)
        return
    with pytest.raises(BatchSpecError) as caught:
        cp.check_compaction(compaction, threshold)
    assert error in str(caught.value)


def test_a_result_without_a_name_is_labelled_with_its_calls_tool() -> None:
    messages = [{"role": "assistant", "content": None, "tool_calls": [call("c0", "grep")]},
                {"role": "tool", "tool_call_id": "c0", "content": "3 hits"}]
    assert "[tool result grep]\n3 hits" in cp.transcript(messages)


# the prompt's size by where the kept tail starts; 100 of it is fixed (system, tools, task)
TAILS = {1: 900.0, 3: 700.0, 5: 500.0, 7: 300.0, 9: 200.0}


@pytest.mark.parametrize(("room", "previous", "start"), [
    (1000, None, 5),  # new: the most kept tail within 100 + (1000 - 100) / 2 = 550
    (1000, 3, 3),  # the last summary's start still fits: kept (its summary is reused)
    (650, 3, 7),  # it no longer fits: a new start within 100 + (650 - 100) / 2 = 375
    (1000, 4, 5),  # not a point of this history: a new start
    (150, None, 9),  # nothing fits: the last point
])
def test_summary_start_keeps_its_start_while_it_fits_and_leaves_a_margin(
        room: int, previous: int | None, start: int) -> None:
    points = sorted(TAILS)
    assert cp.summary_start(points, TAILS.__getitem__, room, 100, previous) == start


def test_the_simulator_reads_the_summary_transcript_and_its_summary_marks_calls_done() -> None:
    """The formats agree: the sim answers agentbatch's summary request with ``@sim done``
    lines for the answered calls, which its script then counts as answered."""
    from agentbatch.sim.script import done_calls, parse_script, summary_reply

    older = [{"role": "assistant", "content": None,
              "tool_calls": [{"id": "a", "function": {"name": "get", "arguments": '{"n": 1}'}},
                             {"id": "b", "function": {"name": "get", "arguments": '{"n": 2}'}}]},
             {"role": "tool", "tool_call_id": "a", "content": "one"},
             {"role": "tool", "tool_call_id": "b", "content": "two"},
             {"role": "assistant", "content": "thinking",
              "tool_calls": [{"id": "c", "function": {"name": "get", "arguments": '{"n": 1}'}}]}]
    request = cp.summary_request_messages(older)[1]["content"]
    summary = summary_reply(request, Counter())
    assert summary is not None
    view = cp.summary_view([{"role": "user", "content": "task"}, *older, *older[-1:]], 5,
                           summary)
    done = done_calls(parse_script([view[0]["content"]]))
    # the unanswered third call is not done
    assert done == Counter({("get", '{"n":1}'): 1, ("get", '{"n":2}'): 1})
    assert summary_reply("Summarize this:\n\n[user]\nhello", Counter()) is None
