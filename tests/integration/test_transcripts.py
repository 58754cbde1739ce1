"""Transcripts (issue 25 item 2): ``keep_transcript=True`` puts each agent's conversation on
``AgentResult.messages`` on both engines, a failed agent keeps its own without it, the
distributed engine keeps the lists in Redis with the batch's retention TTL, ``agentbatch
show`` prints one (escaped, tool outputs cut unless ``--full``), ``agentbatch export`` writes
the results as JSON lines, and ``handle.to_pandas()`` makes a DataFrame.

Real parts: the simulator over HTTP, a real redis-server and real ``agentbatch worker``
processes; the CLI runs as a subprocess. ``@sim`` directives script each agent: agent 0 calls
``shout`` (with an escape sequence and rich markup in its text) and answers, agent 1 calls
``pad`` (2,048 chars out) and then answers text that never validates (``invalid_output``),
agent 2 answers at once.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

from agentbatch import AgentResult, run_batch, submit_batch
from agentbatch.distributed.state.keys import BatchKeys
from tests.support.pure_tools import shout
from tests.support.tools import Answer, pad

pytestmark = [pytest.mark.redis, pytest.mark.slow]

WAIT_S = 180.0
TASK = "Agent {i}.\n{extra}"
HOSTILE = "hello \u001b]0;pwned\u0007 [bold red]loud[/bold red]"
INPUTS = [
    {"i": 0, "extra": "@sim tool shout " + json.dumps({"text": HOSTILE})},
    {"i": 1, "extra": '@sim tool pad {"n": 1}\n@sim answer not json at all'},
    {"i": 2, "extra": ""},
]


def _run(sim_url: str, redis_url: str | None, **kw: Any) -> tuple[str, list[AgentResult]]:
    extra = {"redis_url": redis_url} if redis_url else {}
    with submit_batch(TASK, INPUTS, tools=[shout, pad], output_schema=Answer,
                      model="sim-model", backend=sim_url, max_retries=1, **extra,
                      **kw) as handle:
        return handle.batch_id, handle.wait(timeout=WAIT_S)


def _roles(result: AgentResult) -> list[str]:
    assert result.messages is not None
    return [m["role"] for m in result.messages]


def _called(result: AgentResult) -> list[str]:
    assert result.messages is not None
    return [c["function"]["name"] for m in result.messages for c in m.get("tool_calls") or []]


def _tool_outputs(result: AgentResult) -> list[str]:
    assert result.messages is not None
    return [m["content"] for m in result.messages if m["role"] == "tool"]


def _check_kept(results: list[AgentResult]) -> None:
    ok0, failed1, ok2 = results
    assert [r.ok for r in results] == [True, False, True]
    assert failed1.error is not None and failed1.error.kind == "invalid_output"
    assert _roles(ok0) == ["user", "assistant", "tool", "assistant"]
    assert _called(ok0) == ["shout"] and _tool_outputs(ok0) == [HOSTILE.upper()]
    assert _called(failed1) == ["pad"]
    assert _tool_outputs(failed1)[0].startswith("round 1: xxx")
    assert _roles(ok2) == ["user", "assistant"]
    assert "Agent 2." in ok2.messages[0]["content"]  # type: ignore[index]


def _check_failed_only(results: list[AgentResult]) -> None:
    ok0, failed1, ok2 = results
    assert ok0.messages is None and ok2.messages is None
    assert _called(failed1) == ["pad"] and _roles(failed1)[:3] == ["user", "assistant", "tool"]


@pytest.mark.parametrize("keep", [True, False], ids=["keep", "failed-only"])
def test_embedded_transcripts(sim_url: str, keep: bool) -> None:
    _, results = _run(sim_url, None, keep_transcript=keep)
    (_check_kept if keep else _check_failed_only)(results)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agentbatch.cli", *args], capture_output=True,
                          text=True, timeout=WAIT_S)


def _no_key_without_ttl(client: redis.Redis, batch_id: str) -> list[str]:
    keys = sorted(k.decode() for k in client.scan_iter(match=BatchKeys(batch_id).pattern()))
    assert keys, "the batch left no keys"
    forever = [k for k in keys if client.pttl(k) < 0]
    assert forever == [], forever
    return keys


def test_distributed_keep_transcript_show_and_export(sim_url: str, redis_url: str,
                                                     start_workers, tmp_path: Path) -> None:
    start_workers(1)
    batch_id, results = _run(sim_url, redis_url, keep_transcript=True)
    _check_kept(results)
    client = redis.from_url(redis_url)
    keys = BatchKeys(batch_id)
    listed = _no_key_without_ttl(client, batch_id)
    for i in range(3):
        assert keys.messages(i) in listed and keys.calls(i) not in listed
    # the stream entries do not carry the messages: they are read from the kept lists
    for _, fields in client.xrange(keys.results):
        assert json.loads(fields[b"r"])["messages"] is None and fields[b"m"] == b"1"

    shown = _cli("show", batch_id, "1", "--redis-url", redis_url, "--max-chars", "100")
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    for part in ("agent 1", "invalid_output", "── user", "── assistant", "tool call pad",
                 '"n": 1', "── tool output", "round 1: xxx", "[... 1948 more chars; --full"):
        assert part in out, (part, out)
    whole = _cli("show", batch_id, "1", "--redis-url", redis_url, "--full")
    assert whole.returncode == 0 and "x" * 2000 in whole.stdout and "more chars" not in \
        whole.stdout.split("── tool output", 1)[1], whole.stdout
    hostile = _cli("show", batch_id, "0", "--redis-url", redis_url)
    assert hostile.returncode == 0, hostile.stderr
    assert "\x1b" not in hostile.stdout and "\x07" not in hostile.stdout, hostile.stdout
    assert "\\x1b]0;PWNED\\x07 [BOLD RED]LOUD[/BOLD RED]" in hostile.stdout, hostile.stdout

    target = tmp_path / "results.jsonl"
    exported = _cli("export", batch_id, "-o", str(target), "--redis-url", redis_url)
    assert exported.returncode == 0, exported.stderr
    rows = [json.loads(line) for line in target.read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2]
    assert [r["ok"] for r in rows] == [True, False, True]
    assert [m["role"] for m in rows[0]["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert rows[0]["output"] == results[0].output.model_dump()  # type: ignore[union-attr]


def test_distributed_failed_agent_keeps_its_transcript_alone(sim_url: str, redis_url: str,
                                                             start_workers) -> None:
    start_workers(1)
    batch_id, results = _run(sim_url, redis_url)
    _check_failed_only(results)
    client = redis.from_url(redis_url)
    keys = BatchKeys(batch_id)
    listed = _no_key_without_ttl(client, batch_id)
    assert keys.messages(1) in listed
    assert keys.messages(0) not in listed and keys.messages(2) not in listed
    assert 0 < client.pttl(keys.messages(1)) <= client.pttl(keys.meta) + 60_000
    not_kept = _cli("show", batch_id, "0", "--redis-url", redis_url)
    assert not_kept.returncode == 2 and "was not kept" in not_kept.stderr, not_kept.stderr
    no_agent = _cli("show", batch_id, "3", "--redis-url", redis_url)
    assert no_agent.returncode == 2 and "no agent 3" in no_agent.stderr, no_agent.stderr
    shown = _cli("show", batch_id, "1", "--redis-url", redis_url)
    assert shown.returncode == 0 and "tool call pad" in shown.stdout, shown.stderr


def test_show_and_export_unknown_batch_exit_2(redis_url: str, tmp_path: Path) -> None:
    shown = _cli("show", "no-such-batch", "0", "--redis-url", redis_url)
    assert shown.returncode == 2 and "no batch 'no-such-batch'" in shown.stderr, shown
    target = tmp_path / "out.jsonl"
    exported = _cli("export", "no-such-batch", "-o", str(target), "--redis-url", redis_url)
    assert exported.returncode == 2 and "no batch 'no-such-batch'" in exported.stderr, exported
    assert not target.exists()


def test_export_of_a_deleted_batch_says_so(sim_url: str, redis_url: str, start_workers,
                                           tmp_path: Path) -> None:
    start_workers(1)
    batch_id, _ = _run(sim_url, redis_url)
    from agentbatch import get_batch

    get_batch(batch_id, redis_url=redis_url).delete()
    for args in (("show", batch_id, "1"), ("export", batch_id, "-o", str(tmp_path / "x"))):
        proc = _cli(*args, "--redis-url", redis_url)
        assert proc.returncode == 2 and "deleted" in proc.stderr, proc


@pytest.mark.parametrize("distributed", [False, True], ids=["embedded", "distributed"])
def test_to_pandas(sim_url: str, redis_url: str, start_workers, distributed: bool) -> None:
    pd = pytest.importorskip("pandas", reason="pandas is the optional 'pandas' extra (in the "
                                              "test extra); not installed here")
    if distributed:
        start_workers(1)
    with submit_batch(TASK, INPUTS, tools=[shout, pad], output_schema=Answer,
                      model="sim-model", backend=sim_url, max_retries=1,
                      **({"redis_url": redis_url} if distributed else {})) as handle:
        frame = handle.to_pandas(timeout=WAIT_S)
    assert isinstance(frame, pd.DataFrame)
    assert list(frame.index) == [0, 1, 2]
    assert list(frame["ok"]) == [True, False, True]
    assert frame.loc[1, "error_kind"] == "invalid_output"
    assert frame.loc[0, "prompt_tokens"] > 0
    assert frame.loc[0, "messages"] is None and len(frame.loc[1, "messages"]) >= 3


def test_to_pandas_without_pandas_names_the_extra(sim_url: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pandas", None)  # import pandas raises ImportError
    with submit_batch("Agent {i}.", [{"i": 0}], model="sim-model", backend=sim_url) as handle, \
            pytest.raises(ImportError, match=r"pip install 'agentbatch\[pandas\]'"):
        handle.to_pandas(timeout=WAIT_S)


def test_keep_transcript_is_checked() -> None:
    from agentbatch import BatchSpecError

    with pytest.raises(BatchSpecError, match="keep_transcript must be True or False"):
        run_batch("x", [{}], model="m", backend="sim://127.0.0.1:9", keep_transcript="yes")
