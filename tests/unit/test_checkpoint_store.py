"""The checkpoint store, fingerprint and resume rules (no model, no network)."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest

from agentbatch.core.agent_state import AgentState, AgentStatus
from agentbatch.core.errors import BatchSpecError
from agentbatch.core.results import AgentError
from agentbatch.embedded.checkpoint import (
    DB_NAME,
    CheckpointCorrupted,
    SavedAgent,
    batch_fingerprint,
    open_checkpoint,
    resume,
)


def fp(task: str = "Do {i}.", n: int = 3, tools: tuple[str, ...] = ("m:step@1",)):
    return batch_fingerprint(task, [{"i": i} for i in range(n)], None, list(tools),
                             {"type": "object"})


def fresh(i: int) -> AgentState:
    return AgentState(index=i, input={"i": i}, messages=[{"role": "user", "content": f"{i}"}])


def test_resume_keeps_done_continues_unfinished_and_retries_failed_unless_kept():
    initial = [fresh(i) for i in range(4)]
    done = fresh(0).model_copy(update={"status": AgentStatus.DONE, "output": {"n": 0},
                                       "version": 3})
    midway = fresh(1).model_copy(update={"status": AgentStatus.NEEDS_MODEL, "turns": 2,
                                         "version": 4})
    failed = fresh(2).model_copy(update={"status": AgentStatus.FAILED, "version": 2,
                                         "error": AgentError(kind="max_turns", message="x")})
    saved = {0: SavedAgent(done, 1.5), 1: SavedAgent(midway, None), 2: SavedAgent(failed, 2.5)}

    retried = resume(initial, saved, retry_failed=True)
    assert retried.states == [done, midway, initial[2], initial[3]]
    assert retried.ended == {0: 1.5}
    assert (retried.continued, retried.retried) == (1, 1)

    kept = resume(initial, saved, retry_failed=False)
    assert kept.states == [done, midway, failed, initial[3]]
    assert kept.ended == {0: 1.5, 2: 2.5}
    assert kept.retried == 0


def test_fingerprint_names_each_part_that_differs():
    base = fp()
    assert base.differences(base.parts, 3) == []
    assert fp(task="Other {i}.").differences(base.parts, 3) == ["the task"]
    assert fp(n=4).differences(base.parts, 3) == ["the inputs (4 now, 3 in the checkpoint)"]
    assert fp(tools=("m:step@2",)).differences(base.parts, 3) == ["the tools"]


def test_saves_are_group_committed_and_reload_as_the_latest_state(tmp_path):
    store = open_checkpoint(tmp_path / "ck", fp(n=200))

    async def save_all() -> None:
        states = [fresh(i).model_copy(update={"version": 1, "turns": 1}) for i in range(200)]
        await asyncio.gather(*(store.save(s) for s in states))
        await asyncio.gather(*(store.save(s.model_copy(update={"version": 2, "turns": 2}))
                               for s in states))

    asyncio.run(save_all())
    commits = store.commits
    store.close()
    assert 2 <= commits < 400  # rows queued together share one transaction
    mode = sqlite3.connect(tmp_path / "ck" / DB_NAME).execute("PRAGMA journal_mode").fetchone()
    assert mode == ("wal",)
    again = open_checkpoint(tmp_path / "ck", fp(n=200))
    try:
        assert sorted(again.saved) == list(range(200))
        assert {s.state.version for s in again.saved.values()} == {2}
    finally:
        again.close()


def test_one_open_checkpoint_per_directory(tmp_path):
    store = open_checkpoint(tmp_path / "ck", fp())
    try:
        with pytest.raises(BatchSpecError, match=r"checkpoint_dir .* is in use"):
            open_checkpoint(tmp_path / "ck", fp())
    finally:
        store.close()
    open_checkpoint(tmp_path / "ck", fp()).close()  # released on close


def test_a_saved_state_that_does_not_parse_is_reported_corrupted(tmp_path):
    open_checkpoint(tmp_path / "ck", fp()).close()
    conn = sqlite3.connect(tmp_path / "ck" / DB_NAME)
    with conn:
        conn.execute("INSERT INTO agents VALUES (0, 1, 'done', '{\"index\": \"x\"}', NULL, 0)")
    conn.close()
    with pytest.raises(CheckpointCorrupted, match=r"is corrupted .*agent 0's saved state"):
        open_checkpoint(tmp_path / "ck", fp())


def test_a_failed_write_reaches_the_waiting_agent(tmp_path):
    store = open_checkpoint(tmp_path / "ck", fp())
    store._conn.execute("DROP TABLE agents")  # every later write fails

    async def save() -> None:
        await store.save(fresh(0))

    with pytest.raises(sqlite3.OperationalError, match="no such table"):
        asyncio.run(save())
    store.close()
