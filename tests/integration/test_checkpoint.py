"""Checkpoint and resume on the embedded engine, against the simulator over real HTTP.

The kill test runs the batch in a real subprocess, SIGKILLs it mid-batch (some agents done,
some mid-way, read from the checkpoint itself), runs it again, and counts the model calls the
simulator received.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pydantic import BaseModel

from agentbatch import BatchSpecError, run_batch, tool
from agentbatch.embedded.checkpoint import DB_NAME
from agentbatch.sim.config import SimConfig
from agentbatch.sim.server import SimServer
from tests.support.workers import REPO

DEADLINE_S = 180  # generous: the machine is shared


class Out(BaseModel):
    n: int


@tool
def step(i: int) -> str:
    """One step of the work.

    Args:
        i: which step.
    """
    return f"step {i} done"


@tool
def other_step(i: int) -> str:
    """Another tool.

    Args:
        i: which step.
    """
    return f"other {i}"


def script(i: int, rounds: int, answer: str | None = None) -> str:
    lines = [f'@sim tool step {{"i": {k}}}' for k in range(rounds)]
    return "\n".join([*lines, "@sim answer " + (answer or json.dumps({"n": i}))])


def model_calls(sim: SimServer) -> int:
    return sim.state.stats.as_dict()["requests"].get("chat_completions", 0)


def url_of(sim: SimServer) -> str:
    return "sim://" + sim.url.split("://", 1)[1]


def batch(sim: SimServer, where: Path, inputs: list[dict], **kw):
    kw = {"output_schema": Out, "tools": [step], "model": "sim-model",
          "backend": url_of(sim), "checkpoint_dir": str(where), "warm_prefix": False,
          "max_turns": 8, **kw}
    return run_batch("Do {i}.\n{script}", inputs, **kw)


# --- a re-run: finished agents come back, failures are retried (or kept) ------------------


def test_rerun_returns_ended_agents_from_the_checkpoint_and_retries_failures(sim, tmp_path):
    inputs = [{"i": i, "script": script(i, i % 3, answer="not json" if i == 4 else None)}
              for i in range(6)]
    first_calls = model_calls(sim)
    first = batch(sim, tmp_path / "ck", inputs, max_retries=0)
    first_calls = model_calls(sim) - first_calls
    assert [r.ok for r in first] == [True, True, True, True, False, True]
    assert first_calls == sum(i % 3 + 1 for i in range(6))  # 12

    before = model_calls(sim)
    kept = batch(sim, tmp_path / "ck", inputs, max_retries=0, retry_failed=False)
    assert model_calls(sim) == before  # nothing sent: every agent came from the checkpoint
    assert all(isinstance(r.output, Out) and r.output.n == r.index for r in kept if r.ok)
    assert [r.ok for r in kept] == [True, True, True, True, False, True]
    assert kept[4].error.kind == "invalid_output"
    assert [r.turns for r in kept] == [r.turns for r in first]
    assert [len(r.tool_calls) for r in kept] == [len(r.tool_calls) for r in first]

    before = model_calls(sim)
    retried = batch(sim, tmp_path / "ck", inputs, max_retries=0)
    assert model_calls(sim) - before == 4 % 3 + 1  # only agent 4 ran again, from its start
    assert not retried[4].ok and retried[4].turns == 2


def test_cancelled_agents_continue_on_a_rerun(sim, tmp_path):
    """A cancelled batch (the user stopped it) is not a failure: the re-run continues it."""
    from agentbatch import submit_batch

    inputs = [{"i": i, "script": script(i, 3)} for i in range(3)]
    slow = SimServer(SimConfig(fixed_ms=400)).start()
    try:
        handle = submit_batch("Do {i}.\n{script}", inputs, output_schema=Out, tools=[step],
                              model="sim-model", backend=url_of(slow), warm_prefix=False,
                              checkpoint_dir=str(tmp_path / "ck"))
        deadline = time.monotonic() + DEADLINE_S
        while not _rows(tmp_path / "ck" / DB_NAME) and time.monotonic() < deadline:
            time.sleep(0.05)
        handle.cancel()
        ended = handle.wait(timeout=DEADLINE_S)
        handle.close()  # releases the checkpoint (run_batch closes its handle itself)
        assert all(r.error and r.error.kind == "cancelled" for r in ended)
        sent = model_calls(slow)
        rows = _rows(tmp_path / "ck" / DB_NAME)
        assert rows and all(status != "cancelled" for status, _ in rows.values())
        again = batch(slow, tmp_path / "ck", inputs)
        assert all(r.ok and isinstance(r.output, Out) for r in again)
        committed = sum(steps for _, steps in rows.values())
        assert model_calls(slow) - sent == 3 * 4 - committed  # the committed turns not redone
    finally:
        slow.stop()


# --- bad input ----------------------------------------------------------------------------


def test_checkpoint_of_another_batch_is_refused_naming_what_differs(sim, tmp_path):
    inputs = [{"i": i, "script": script(i, 1)} for i in range(2)]
    batch(sim, tmp_path / "ck", inputs)
    with pytest.raises(BatchSpecError, match=r"checkpoint_dir .*different batch: the task "
                                             r"differ"):
        run_batch("Now do {i}.\n{script}", inputs, output_schema=Out, tools=[step],
                  model="sim-model", backend=url_of(sim), checkpoint_dir=str(tmp_path / "ck"))
    with pytest.raises(BatchSpecError, match=r"the inputs \(3 now, 2 in the checkpoint\)"):
        batch(sim, tmp_path / "ck", [*inputs, {"i": 9, "script": script(9, 0)}])
    with pytest.raises(BatchSpecError, match=r"different batch: the tools differ"):
        batch(sim, tmp_path / "ck", inputs, tools=[step, other_step])
    with pytest.raises(BatchSpecError, match=r"the system prompt, the output schema differ"):
        batch(sim, tmp_path / "ck", inputs, system_prompt="Be brief.", output_schema=None)


@pytest.mark.parametrize("damage", ["garbage", "torn_pages"])
def test_corrupted_database_is_refused_and_not_overwritten(sim, tmp_path, damage):
    where = tmp_path / "ck"
    inputs = [{"i": i, "script": script(i, 1)} for i in range(3)]
    if damage == "garbage":
        where.mkdir()
        (where / DB_NAME).write_bytes(os.urandom(8192))
    else:  # a real checkpoint, its pages after the first overwritten
        batch(sim, where, inputs)
        data = bytearray((where / DB_NAME).read_bytes())
        assert len(data) >= 8192
        data[4096:] = b"\xa5" * (len(data) - 4096)
        (where / DB_NAME).write_bytes(bytes(data))
    digest = hashlib.sha256((where / DB_NAME).read_bytes()).hexdigest()
    before = model_calls(sim)
    with pytest.raises(BatchSpecError, match=r"checkpoint_dir .*is corrupted.*left as it is"):
        batch(sim, where, inputs)
    assert hashlib.sha256((where / DB_NAME).read_bytes()).hexdigest() == digest
    assert model_calls(sim) == before


def test_unusable_checkpoint_dirs_are_refused_naming_checkpoint_dir(sim, tmp_path):
    inputs = [{"i": 0, "script": script(0, 0)}]
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(BatchSpecError, match=r"checkpoint_dir '.*a_file' is a file"):
        batch(sim, a_file, inputs)
    # Under a file: mkdir fails with ENOTDIR whoever runs it, root included.
    with pytest.raises(BatchSpecError, match=r"checkpoint_dir '.*a_file/ck' cannot be created"):
        batch(sim, a_file / "ck", inputs)
    # An existing directory nobody can create files in: /proc refuses even root (chmod
    # would not stop root, so a read-only mode bit proves nothing here).
    with pytest.raises(BatchSpecError, match=r"checkpoint_dir '/proc' cannot be created or "
                                             r"written"):
        batch(sim, Path("/proc"), inputs)
    with pytest.raises(BatchSpecError, match=r"checkpoint_dir must be a directory path"):
        batch(sim, tmp_path, inputs, checkpoint_dir=3)
    with pytest.raises(BatchSpecError, match=r"retry_failed must be True or False"):
        batch(sim, tmp_path / "ck", inputs, retry_failed="no")


def test_distributed_engine_refuses_checkpoint_dir_saying_why(tmp_path):
    # Refused while checking the options, before Redis is contacted (nothing listens here).
    with pytest.raises(BatchSpecError, match=r"checkpoint_dir is for the embedded engine.*"
                                             r"survives the submitter's death by design"):
        run_batch("Do {i}.", [{"i": 1}], model="m", backend="sim://127.0.0.1:9",
                  redis_url="redis://127.0.0.1:9/0", checkpoint_dir=str(tmp_path / "ck"))
    assert not (tmp_path / "ck").exists()


def test_a_running_batchs_checkpoint_is_refused_to_a_second_run(sim, tmp_path):
    from agentbatch import submit_batch

    inputs = [{"i": 0, "script": script(0, 0)}]
    slow = SimServer(SimConfig(fixed_ms=2000)).start()
    try:
        handle = submit_batch("Do {i}.\n{script}", inputs, output_schema=Out, tools=[step],
                              model="sim-model", backend=url_of(slow), warm_prefix=False,
                              checkpoint_dir=str(tmp_path / "ck"))
        with pytest.raises(BatchSpecError, match=r"checkpoint_dir .* is in use by another "
                                                 r"running batch"):
            batch(sim, tmp_path / "ck", inputs)
        assert handle.wait(timeout=DEADLINE_S)[0].ok
        handle.close()
    finally:
        slow.stop()


# --- SIGKILL mid-batch ----------------------------------------------------------------------

RUNNER = '''
import json, sys
from pydantic import BaseModel
from agentbatch import run_batch, tool

class Out(BaseModel):
    n: int

@tool
def step(i: int) -> str:
    """One step of the work.

    Args:
        i: which step.
    """
    return f"step {i} done"

def script(i):
    lines = [f'@sim tool step {{"i": {k}}}' for k in range(i % 4)]
    return "\\n".join(lines + ['@sim answer {"n": %d}' % i])

url, where, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
results = run_batch("Do {i}.\\n{script}", [{"i": i, "script": script(i)} for i in range(n)],
                    output_schema=Out, tools=[step], model="sim-model", backend=url,
                    checkpoint_dir=where, warm_prefix=False, max_turns=8, max_inflight=n)
print(json.dumps([[r.index, r.ok, type(r.output).__name__, r.output.n if r.ok else None]
                  for r in results]))
'''
AGENTS = 8  # agent i takes i % 4 tool rounds: 1 to 4 model calls


def _rows(db: Path) -> dict[int, tuple[str, int]]:
    """index -> (status, model turns committed), read-only, as the checkpoint holds them."""
    if not db.exists():
        return {}
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            got = conn.execute("SELECT idx, status, state FROM agents").fetchall()
        finally:
            conn.close()
    except sqlite3.OperationalError:  # not created yet
        return {}
    return {i: (status, json.loads(state)["turns"]) for i, status, state in got}


def _run(runner: Path, url: str, where: Path) -> list[list]:
    done = subprocess.run([sys.executable, str(runner), url, str(where), str(AGENTS)],
                          cwd=REPO, capture_output=True, text=True, timeout=DEADLINE_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_sigkilled_batch_loses_no_agent_and_repeats_only_inflight_turns(tmp_path):
    runner = tmp_path / "runner.py"
    runner.write_text(RUNNER)
    expected = [[i, True, "Out", i] for i in range(AGENTS)]
    with SimServer(SimConfig(fixed_ms=300)) as sim:
        url = url_of(sim)
        assert _run(runner, url, tmp_path / "whole") == expected
        uninterrupted = model_calls(sim)
        assert uninterrupted == sum(i % 4 + 1 for i in range(AGENTS))  # 20

        sim.state.stats.reset()
        where = tmp_path / "killed"
        db = where / DB_NAME
        proc = subprocess.Popen([sys.executable, str(runner), url, str(where), str(AGENTS)],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + DEADLINE_S
            while True:  # until some agents are done and some are mid-way, per the checkpoint
                rows = _rows(db)
                done = [i for i, (s, _) in rows.items() if s == "done"]
                midway = [i for i, (s, turns) in rows.items()
                          if s in ("needs_model", "awaiting_tools") and turns >= 1]
                if done and midway:
                    break
                assert proc.poll() is None, "the batch ended before it could be killed"
                assert time.monotonic() < deadline, f"no mid-batch moment seen: {rows}"
                time.sleep(0.02)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=30)
        assert proc.returncode == -signal.SIGKILL
        rows = _rows(db)  # what the killed run had committed
        done = sum(1 for s, _ in rows.values() if s == "done")
        # A model call not yet reflected in the checkpoint: the agent's committed state is
        # waiting on the model (or it has none yet). Tool rounds are not model calls.
        inflight = sum(1 for i in range(AGENTS)
                       if rows.get(i, ("needs_model", 0))[0] == "needs_model")
        killed_calls = model_calls(sim)
        assert 0 < done < AGENTS and killed_calls < uninterrupted

        assert _run(runner, url, where) == expected  # every agent, each an Out instance
        total = model_calls(sim)
        print(f"uninterrupted={uninterrupted} killed_run={killed_calls} "
              f"rerun={total - killed_calls} done_at_kill={done} inflight_at_kill={inflight}")
        assert total <= uninterrupted + inflight
        assert total - killed_calls < uninterrupted  # the re-run resumed; it did not start over


def test_cli_run_resumes_from_checkpoint_dir(sim, tmp_path):
    (tmp_path / "spec.yaml").write_text(f"""
task: |
  Say {{{{"n": {{i}}}}}}.
  @sim answer {{{{"n": {{i}}}}}}
inputs: [{{"i": 1}}, {{"i": 2}}, {{"i": 3}}]
model: sim-model
backend: "{url_of(sim)}"
warm_prefix: false
""")
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def cli(out: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "agentbatch.cli", "run", str(tmp_path / "spec.yaml"), "-o",
             str(tmp_path / out), "--checkpoint-dir", str(tmp_path / "ck")],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=DEADLINE_S)

    before = model_calls(sim)
    first = cli("first.jsonl")
    assert first.returncode == 0, first.stderr[-3000:]
    assert model_calls(sim) - before == 3
    assert (tmp_path / "ck" / DB_NAME).exists()
    again = cli("again.jsonl")
    assert again.returncode == 0, again.stderr[-3000:]
    assert model_calls(sim) - before == 3  # the re-run sent nothing
    assert "3 ok, 0 failed" in again.stdout
    rows = [json.loads(line) for line in (tmp_path / "again.jsonl").read_text().splitlines()]
    assert sorted(json.loads(r["output"])["n"] for r in rows) == [1, 2, 3]  # free text
