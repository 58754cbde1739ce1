"""Linear history: what one distributed transition writes to Redis does not grow with the turns.

Real redis-server, a real ``agentbatch worker`` and the simulator over HTTP; Redis ``MONITOR``
(commands inside scripts included) records every write to the agent's state entry and lists.
"""

from __future__ import annotations

import pytest

from agentbatch import submit_batch
from agentbatch.distributed.state.keys import BatchKeys
from tests.support.redis_monitor import MonitorRecorder
from tests.support.tools import pad

pytestmark = [pytest.mark.redis, pytest.mark.slow]

WORKER_ENV = {"AGENTBATCH_WORKER_IMPORTS": "tests.support"}


def _writes(redis_url: str, sim_url: str, rounds: int) -> tuple[list[int], list[int]]:
    """(sizes of the agent's state-entry writes, bytes of each list append) for one agent
    making ``rounds`` tool rounds whose tool returns 2 KB."""
    task = "Agent {i}.\n" + "".join(f'@sim tool pad {{{{"n": {n}}}}}\n' for n in range(rounds))
    with MonitorRecorder(redis_url) as monitor:
        handle = submit_batch(task, [{"i": 0}], tools=[pad], model="sim-model",
                              backend=sim_url, redis_url=redis_url, max_turns=rounds + 2)
        results = handle.wait(timeout=120)
    assert results[0].ok and len(results[0].tool_calls) == rounds, results[0]
    assert [c.arguments for c in results[0].tool_calls] == [{"n": n} for n in range(rounds)]
    k = BatchKeys(handle.batch_id)
    lists = (k.messages(0).encode(), k.calls(0).encode())
    entry, appended = [], []
    for args in monitor.commands:
        if len(args) < 3:
            continue
        command, key = args[0].upper(), args[1]
        if command == b"HSET" and key == k.state.encode() and args[2] == b"0":
            entry.append(len(args[3]))
        elif command == b"RPUSH" and key in lists:
            appended.append(sum(len(a) for a in args[2:]))
    return entry[1:], appended  # the first is the submit's, which carries the task itself


def test_a_transition_writes_its_new_messages_and_a_state_entry_that_does_not_grow(
        redis_url, sim_url, start_workers):
    start_workers(1, concurrency=4, env=WORKER_ENV)
    entry_3, appended_3 = _writes(redis_url, sim_url, 3)
    entry_15, appended_15 = _writes(redis_url, sim_url, 15)
    # Every transition rewrites the state entry; with the conversation or the tool-call log
    # in it, it grew by ~90 bytes a round (over 1 KB more at 15 rounds than at 3).
    assert len(entry_15) > len(entry_3) >= 6
    assert max(entry_15) - max(entry_3) < 64, (entry_3, entry_15)
    # Appends carry only what a transition adds: one 2 KB tool result with its record, or
    # one assistant message; never the history.
    assert max(appended_15) < 2048 + 512, appended_15
    assert len(appended_15) > len(appended_3)
