"""Live progress (issue 25 item 1): ``handle.progress()`` on both engines, ``agentbatch
watch`` in a subprocess, and ``run_batch(progress=True)`` drawn on a forced rich console.

Real parts: the simulator over HTTP, a real redis-server and a real ``agentbatch worker``.
Agents are held where the test must see them: agent 0 in the ``gate`` tool (awaiting tools)
until the test sets a Redis key, agent 1 in a model call the simulator holds (its ``timeout``
fault, 30 s) until ``timeout_per_turn`` ends it as a ``timeout`` failure. No timing asserts:
every wait polls with a generous deadline.
"""

from __future__ import annotations

import io
import subprocess
import sys
import time
import uuid
from collections.abc import Callable

import pytest
import redis
from rich.console import Console

from agentbatch import BatchSpecError, get_batch, run_batch, submit_batch
from agentbatch.turnloop import progress_display
from agentbatch.turnloop.handle import BatchHandle
from agentbatch.turnloop.progress import BatchProgress
from tests.support.contract_tools import gate

pytestmark = [pytest.mark.redis, pytest.mark.slow]

WAIT_S = 180.0
HELD_TURN_S = 20.0  # agent 1's model call lasts this long (the simulator holds it 30 s)
TASK = "Agent {i}.\n{extra}"


def _inputs(url: str, key: str) -> list[dict[str, object]]:
    held_in_tool = '@sim tool gate {"url": "' + url + '", "key": "' + key + '"}'
    return [{"i": 0, "extra": held_in_tool}, {"i": 1, "extra": "@sim fail timeout"}]


def _adds_up(p: BatchProgress) -> None:
    assert p.done + p.failed + p.running + p.awaiting_tools + p.queued == p.total, p


def _poll(handle: BatchHandle, until: Callable[[BatchProgress], bool]) -> BatchProgress:
    deadline = time.monotonic() + WAIT_S
    seen: BatchProgress | None = None
    while time.monotonic() < deadline:
        seen = handle.progress()
        _adds_up(seen)
        if until(seen):
            return seen
        time.sleep(0.05)
    raise AssertionError(f"progress never reached the expected state; last: {seen}")


def _check_run(handle: BatchHandle, client: redis.Redis, key: str, engine: str,
               while_held: Callable[[], None] = lambda: None) -> BatchProgress:
    """Agent 0 seen awaiting tools and agent 1 running at once; then the end."""
    try:
        held = _poll(handle, lambda p: p.awaiting_tools == 1 and p.running == 1)
        assert held.engine == engine and held.total == 2
        assert held.done == held.failed == held.queued == 0
        assert 1 in [a.index for a in held.slowest], held.slowest
        while_held()
    finally:
        client.set(key, 1)
    results = handle.wait(timeout=WAIT_S)
    assert [r.ok for r in results] == [True, False]
    assert results[1].error is not None and results[1].error.kind == "timeout"
    final = _poll(handle, lambda p: p.finished)
    _adds_up(final)
    assert (final.done, final.failed, final.running, final.awaiting_tools, final.queued) \
        == (1, 1, 0, 0, 0)
    assert dict(final.failed_by_kind) == {"timeout": 1}
    assert final.tokens is not None and final.tokens.prompt > 0
    assert final.eta_s == 0.0
    return final


def test_embedded_progress_sees_held_agents_and_adds_up(sim_url: str, redis_url: str) -> None:
    key = f"progress:gate:{uuid.uuid4().hex}"
    client = redis.from_url(redis_url)
    with submit_batch(TASK, _inputs(redis_url, key), tools=[gate],
                      model="sim-model", backend=sim_url, max_retries=0,
                      timeout_per_turn=HELD_TURN_S) as handle:
        final = _check_run(handle, client, key, "embedded")
    assert final.recovering == 0


def _watch(batch_id: str, redis_url: str, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "agentbatch.cli", "watch", batch_id, "--redis-url", redis_url,
         "--interval", "0.2", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_distributed_progress_and_watch(sim_url: str, redis_url: str, start_workers) -> None:
    start_workers(1)
    key = f"progress:gate:{uuid.uuid4().hex}"
    client = redis.from_url(redis_url)
    watchers: list[subprocess.Popen[str]] = []
    with submit_batch(TASK, _inputs(redis_url, key), tools=[gate],
                      model="sim-model", backend=sim_url, max_retries=0,
                      timeout_per_turn=HELD_TURN_S, redis_url=redis_url) as handle:
        try:
            # started while the batch runs, from another process: it must end by itself
            _check_run(handle, client, key, "distributed",
                       while_held=lambda: watchers.append(
                           _watch(handle.batch_id, redis_url, "--timeout", str(WAIT_S))))
            [watcher] = watchers
            out, err = watcher.communicate(timeout=WAIT_S)
        finally:
            for w in watchers:
                if w.poll() is None:
                    w.kill()
                    w.wait(timeout=30)
        assert watcher.returncode == 0, (out, err)
        assert f"batch {handle.batch_id} finished [distributed]: 1 done, 1 failed " \
               "(timeout 1), total 2" in out, out
        assert "tokens: " in out and "cache hit" in out, out
        # a finished batch still retained: the final counts at once
        again = _watch(handle.batch_id, redis_url)
        out, err = again.communicate(timeout=WAIT_S)
        assert again.returncode == 0 and "1 done, 1 failed" in out, (out, err)
    get_batch(handle.batch_id, redis_url=redis_url).delete()
    expired = _watch(handle.batch_id, redis_url)
    out, err = expired.communicate(timeout=WAIT_S)
    assert expired.returncode == 2, (out, err)
    assert handle.batch_id in err and "deleted" in err, err


def test_watch_unknown_batch_exits_2(redis_url: str) -> None:
    proc = _watch("no-such-batch", redis_url)
    out, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 2, (out, err)
    assert "no batch 'no-such-batch'" in err, err


def test_run_batch_progress_renders_counts(sim_url: str, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    buf = io.StringIO()
    monkeypatch.setattr(progress_display, "_stderr_console",
                        lambda: Console(file=buf, force_terminal=True, width=160))
    results = run_batch("Agent {i}.", [{"i": i} for i in range(3)], model="sim-model",
                        backend=sim_url, progress=True)
    assert [r.ok for r in results] == [True, True, True]
    shown = buf.getvalue()
    assert "[embedded]" in shown and "3/3" in shown, shown
    assert "3 done, 0 failed, 0 running, 0 awaiting tools" in shown, shown


def test_progress_option_is_checked_and_off_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(BatchSpecError, match="progress must be True, False or None"):
        run_batch("x", [{}], model="m", backend="sim://127.0.0.1:9", progress="yes")
    monkeypatch.setenv("CI", "true")
    assert progress_display.resolve(None) is False
    assert progress_display.resolve(True) is True
    monkeypatch.delenv("CI")
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal
    assert progress_display.resolve(None) is False
    assert progress_display.resolve(False) is False
