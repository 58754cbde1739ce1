"""Context limits and compaction, on both engines, over the simulator's real HTTP.

An agent whose tool outputs outgrow the model's context was sent to the server anyway (a
200k-word prompt went as is; a real server answers HTTP 400). Here the simulator states a
small ``max_model_len`` on ``/v1/models`` and refuses longer prompts with vLLM's 400. The
agent's tool returns 1,500 chars per call, six times: without compaction it ends
``context_overflow`` before any over-long prompt is sent; with ``compaction="truncate"`` it
ends ok. Either way the server never refused a request. The tool reads the simulator's
cumulative token counters each time it runs (one agent, so after each model request): every
request after the first has the shared prefix (system prompt + tools) served from the cache,
the compacted ones included.
"""

from __future__ import annotations

import itertools
import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentbatch import run_batch, submit_batch, tool
from agentbatch.core.errors import BatchSpecError
from agentbatch.distributed.state.keys import BatchKeys
from agentbatch.sim.config import SimConfig
from agentbatch.sim.server import SimServer
from agentbatch.sim.tokens import BLOCK_CHARS, BLOCK_TOKENS
from tests.support.redis_monitor import MonitorRecorder

CONTEXT = 8000  # the simulator's max_model_len, in its /tokenize tokens (code points)
OUTPUT_CHARS = 1500
ROUNDS = 6
SYSTEM = "You are a careful agent that reads every tool output. " * 36  # ~2,000 chars
# The prompt's first blocks are the system message: each request after the first must find
# at least these tokens in the simulator's prefix cache.
PREFIX_CACHED = (len("<|system|>" + SYSTEM) // BLOCK_CHARS) * BLOCK_TOKENS
IMPORTS = {"AGENTBATCH_WORKER_IMPORTS": "tests.support,tests.integration.test_context_limits"}
DEADLINE_S = 120.0


@tool
def big(n: int, stats_url: str, log: str) -> str:
    """A long tool output; also notes the simulator's token counters so far.

    Args:
        n: the call's number.
        stats_url: the simulator's /sim/stats URL.
        log: a file the counters are appended to.
    """
    with urllib.request.urlopen(stats_url, timeout=30) as resp:
        stats = json.load(resp)
    with open(log, "a") as f:
        f.write(json.dumps({"n": n, "prompt": stats["prompt_tokens"],
                            "cached": stats["cached_tokens"]}) + "\n")
    return f"output {n}: " + ("lorem ipsum " * 200)[:OUTPUT_CHARS]


@pytest.fixture
def small_sim() -> Iterator[SimServer]:
    with SimServer(SimConfig(fixed_ms=5, max_model_len=CONTEXT)) as server:
        yield server


def _task(server: SimServer, log: Path) -> str:
    stats = f"{server.url}/sim/stats"
    calls = [f'@sim tool big {{"n": {n}, "stats_url": "{stats}", "log": "{log}"}}'
             for n in range(1, ROUNDS + 1)]
    return "Read the outputs.\n" + "\n".join(calls) + "\n@sim answer done"


def _sim_stats(server: SimServer) -> dict:
    with urllib.request.urlopen(f"{server.url}/sim/stats", timeout=30) as resp:
        return json.load(resp)


def _run(server: SimServer, tmp_path: Path, **options):
    tmp_path.mkdir(exist_ok=True)
    log = tmp_path / "counters.jsonl"
    task = _task(server, log).replace("{", "{{").replace("}", "}}")
    backend = "sim://" + server.url.split("://", 1)[1]
    handle = submit_batch(task, [{}], system_prompt=SYSTEM, tools=[big], model="m",
                          backend=backend, max_turns=ROUNDS + 2, max_tokens=64,
                          warm_prefix=False, **options)
    [result] = handle.wait(timeout=DEADLINE_S)
    return result, log


def _per_request_cached(server: SimServer, log: Path) -> list[int]:
    """Cached tokens of each model request, from the cumulative counters."""
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    cumulative = [0, *(r["cached"] for r in rows), _sim_stats(server)["cached_tokens"]]
    return [b - a for a, b in itertools.pairwise(cumulative)]


def _check_overflow(server: SimServer, result) -> None:
    assert not result.ok and result.error.kind == "context_overflow", result.error
    assert f"> the context of {CONTEXT} tokens" in result.error.message, result.error.message
    assert "compaction=None" in result.error.message
    assert _sim_stats(server)["bad_requests"] == 0  # no over-long prompt reached the server


def _check_truncated(server: SimServer, result, log: Path) -> None:
    assert result.ok, result.error
    assert result.output == "done" and len(result.tool_calls) == ROUNDS
    assert result.usage.prompt_count == "counted"  # sized with the simulator's /tokenize
    assert _sim_stats(server)["bad_requests"] == 0
    cached = _per_request_cached(server, log)
    assert len(cached) == ROUNDS + 1  # one model request per tool round, plus the answer
    assert all(c >= PREFIX_CACHED for c in cached[1:]), (PREFIX_CACHED, cached)


# -- embedded ------------------------------------------------------------------------------


def test_embedded_a_growing_conversation_ends_context_overflow_without_compaction(
        small_sim: SimServer, tmp_path: Path) -> None:
    result, _ = _run(small_sim, tmp_path)
    _check_overflow(small_sim, result)
    assert 1 < len(result.tool_calls) < ROUNDS


def test_embedded_truncate_fits_it_and_keeps_the_prefix_cached(small_sim: SimServer,
                                                               tmp_path: Path) -> None:
    result, log = _run(small_sim, tmp_path, compaction="truncate")
    _check_truncated(small_sim, result, log)


def test_the_simulator_refuses_an_over_long_prompt_like_vllm(small_sim: SimServer) -> None:
    """The guard above is real: a prompt over max_model_len is an HTTP 400 from the sim."""
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * CONTEXT}]})
    request = urllib.request.Request(f"{small_sim.url}/v1/chat/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=30)
    assert caught.value.code == 400
    assert f"maximum context length is {CONTEXT} tokens" in caught.value.read().decode()


def test_a_max_context_tokens_option_overrides_the_server(small_sim: SimServer,
                                                          tmp_path: Path) -> None:
    result, _ = _run(small_sim, tmp_path, max_context_tokens=3000)
    assert result.error is not None and result.error.kind == "context_overflow"
    assert "the context of 3000 tokens (max_context_tokens)" in result.error.message
    assert len(result.tool_calls) < 2


@pytest.mark.parametrize(("options", "name"), [
    ({"compaction": "shorten"}, "compaction"),
    ({"compaction": "truncate", "compaction_threshold": 0}, "compaction_threshold"),
    ({"compaction": "truncate", "compaction_threshold": 1.5}, "compaction_threshold"),
    ({"max_context_tokens": 0}, "max_context_tokens"),
])
def test_bad_context_options_are_refused_naming_them(options: dict, name: str,
                                                     sim_url: str) -> None:
    with pytest.raises(BatchSpecError, match=name):
        run_batch("hi", [{}], model="m", backend=sim_url, **options)


# -- distributed ---------------------------------------------------------------------------


@pytest.mark.redis
def test_distributed_overflow_without_compaction_and_ok_with_truncate(
        small_sim: SimServer, tmp_path: Path, redis_url: str, start_workers) -> None:
    start_workers(1, env=IMPORTS)
    plain, _ = _run(small_sim, tmp_path / "plain", redis_url=redis_url)
    _check_overflow(small_sim, plain)
    small_sim_reset(small_sim)
    result, log = _run(small_sim, tmp_path / "cut", redis_url=redis_url, compaction="truncate")
    _check_truncated(small_sim, result, log)


def small_sim_reset(server: SimServer) -> None:
    """Fresh counters and cache for the next run (``POST /sim/reset``)."""
    request = urllib.request.Request(f"{server.url}/sim/reset", data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=30):
        pass


# -- summarize -------------------------------------------------------------------------------
# compaction="summarize" asks the model for a summary of the older turns and appends it to the
# task message. The simulator's answer to such a request (agentbatch's transcript of calls and
# results) lists the calls it saw as ``@sim done`` lines, so its script does not call them
# again. ``chunk`` returns shorter outputs than ``big`` over more rounds, so one summary can
# serve several turns; its counters go to the file named by $CTX_LOG (the simulator's URL in
# $CTX_STATS_URL), which keeps the task's call lines, and so the prompt's fixed part, short.

SUM_ROUNDS = 14
SUM_OUTPUT_CHARS = 450
SUM_ENV = ("CTX_STATS_URL", "CTX_LOG")


@tool
def chunk(n: int) -> str:
    """A medium tool output; notes the simulator's counters so far in $CTX_LOG.

    Args:
        n: the call's number.
    """
    with urllib.request.urlopen(os.environ["CTX_STATS_URL"], timeout=30) as resp:
        stats = json.load(resp)
    with open(os.environ["CTX_LOG"], "a") as f:
        f.write(json.dumps({"n": n, "requests": stats["requests_total"],
                            "cached": stats["cached_tokens"]}) + "\n")
    return f"output {n}: " + ("lorem ipsum " * 50)[:SUM_OUTPUT_CHARS]


def _sum_env(server: SimServer, log: Path) -> dict[str, str]:
    return {"CTX_STATS_URL": f"{server.url}/sim/stats", "CTX_LOG": str(log)}


def _run_chunks(server: SimServer, log: Path, **options):
    task = "Read the outputs.\n" + "".join(f'@sim tool chunk {{{{"n": {n}}}}}\n'
                                           for n in range(1, SUM_ROUNDS + 1))
    backend = "sim://" + server.url.split("://", 1)[1]
    handle = submit_batch(task + "@sim answer done", [{}], system_prompt=SYSTEM, tools=[chunk],
                          model="m", backend=backend, max_turns=SUM_ROUNDS + 2, max_tokens=64,
                          warm_prefix=False, **options)
    [result] = handle.wait(timeout=DEADLINE_S)
    return result, handle


def _check_summarized(server: SimServer, result, log: Path) -> int:
    """The agent made every call once and answered; returns the summary requests made."""
    assert result.ok, result.error
    assert result.output == "done"
    assert [c.arguments for c in result.tool_calls] == [{"n": n}
                                                         for n in range(1, SUM_ROUNDS + 1)]
    stats = _sim_stats(server)
    assert stats["bad_requests"] == 0  # no prompt over the context reached the server
    summaries = stats["requests_total"] - result.turns  # requests that were not agent turns
    assert result.turns == SUM_ROUNDS + 1
    assert summaries >= 1
    # Per interval between tool runs: the model requests made (the agent's turn, and a
    # summary request before it when one was made) and the cached tokens they got.
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    ends = [*rows, {"requests": stats["requests_total"], "cached": stats["cached_tokens"]}]
    made = [b["requests"] - a["requests"] for a, b in itertools.pairwise([{"requests": 0}, *ends])]
    cached = [b["cached"] - a["cached"] for a, b in itertools.pairwise([{"cached": 0}, *ends])]
    assert sum(made) == stats["requests_total"] and set(made) <= {1, 2}, made
    first_summary = made.index(2)
    # Turns with no summary request in their interval are the agent's request alone: each
    # after the first has the shared prefix from the cache, summarized turns included.
    alone = [i for i, m in enumerate(made) if m == 1 and i > 0]
    assert all(cached[i] >= PREFIX_CACHED for i in alone), (PREFIX_CACHED, made, cached)
    assert any(i > first_summary for i in alone), made  # a summarized turn, measured alone
    return summaries


def test_embedded_summarize_fits_it_with_few_summary_calls_and_keeps_the_prefix_cached(
        small_sim: SimServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "plain.jsonl"
    for name, value in _sum_env(small_sim, log).items():
        monkeypatch.setenv(name, value)
    plain, _ = _run_chunks(small_sim, log)
    _check_overflow(small_sim, plain)
    small_sim_reset(small_sim)
    log = tmp_path / "summarized.jsonl"
    monkeypatch.setenv("CTX_LOG", str(log))
    result, _ = _run_chunks(small_sim, log, compaction="summarize")
    summaries = _check_summarized(small_sim, result, log)
    # A summary serves the turns after it until its kept tail no longer fits: fewer summary
    # requests than turns past the threshold (one per turn before summary_start's margin).
    assert summaries <= SUM_ROUNDS // 3, summaries


@pytest.mark.redis
def test_distributed_summarize_fits_it_and_the_stored_history_only_grows(
        small_sim: SimServer, tmp_path: Path, redis_url: str, start_workers) -> None:
    log = tmp_path / "counters.jsonl"
    start_workers(1, env={**IMPORTS, **_sum_env(small_sim, log)})
    plain, _ = _run_chunks(small_sim, log, redis_url=redis_url)
    _check_overflow(small_sim, plain)
    small_sim_reset(small_sim)
    log.unlink()
    with MonitorRecorder(redis_url) as monitor:
        result, handle = _run_chunks(small_sim, log, redis_url=redis_url,
                                     compaction="summarize", keep_transcript=True)
    summaries = _check_summarized(small_sim, result, log)
    # One worker keeps its summaries, as the embedded engine does (a worker that did not make
    # an agent's last summary makes one more: see docs).
    assert summaries <= SUM_ROUNDS // 3, summaries
    # The agent's msgs list was only appended to: the summary is a view of each turn's
    # prompt, never written back, and the kept conversation has every full tool output.
    msgs = BatchKeys(handle.batch_id).messages(0).encode()
    writes = {args[0].upper() for args in monitor.commands if len(args) > 1 and args[1] == msgs}
    assert b"RPUSH" in writes and not writes & LIST_REWRITES, writes
    outputs = [m["content"] for m in result.messages or [] if m.get("role") == "tool"]
    assert outputs == [f"output {n}: " + ("lorem ipsum " * 50)[:SUM_OUTPUT_CHARS]
                       for n in range(1, SUM_ROUNDS + 1)]
    assert not any("agentbatch replaced" in json.dumps(m) for m in result.messages or [])


# Redis commands that change or drop what a list already holds.
LIST_REWRITES = {b"LSET", b"LTRIM", b"LREM", b"LPOP", b"RPOP", b"LINSERT", b"DEL", b"UNLINK",
                 b"LMOVE", b"RENAME", b"SET"}
