"""Spend and projected cost in the CLI and the live view (issue 27 item 1): ``agentbatch
status``, ``agentbatch watch`` and ``agentbatch show`` in subprocesses, and
``run_batch(progress=True)`` drawn on a forced rich console. With ``prices`` they show the
spend so far and the projected cost to complete (``progress_display.cost_line``, from
``handle.progress()``); without prices, nothing about cost.

Real parts: the simulator over HTTP, a real redis-server and a real ``agentbatch worker``.
Agent 0 is held in the ``gate`` tool (awaiting tools, one reply paid for) until the test
sets a Redis key, so the CLI is seen on a running batch; agent 1 ends at its first reply.
No timing asserts: every wait polls with a generous deadline.
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis
from rich.console import Console

from agentbatch import run_batch, submit_batch
from agentbatch.turnloop import progress_display
from agentbatch.turnloop.handle import BatchHandle
from agentbatch.turnloop.progress import BatchProgress
from tests.support.contract_tools import gate

pytestmark = [pytest.mark.redis, pytest.mark.slow]

MODEL = "sim-model"
# high rates, so a few hundred tokens cost more than the four decimals shown
PRICES = {MODEL: {"prompt": 1000.0, "cached_prompt": 100.0, "completion": 5000.0}}
WAIT_S = 180.0
TASK = "Agent {i}.\n{extra}"
DOLLARS = r"\$[\d,]+\.\d{4}"


def _inputs(url: str, key: str) -> list[dict[str, object]]:
    held_in_tool = '@sim tool gate {"url": "' + url + '", "key": "' + key + '"}'
    return [{"i": 0, "extra": held_in_tool}, {"i": 1, "extra": ""}]


def _cli(*args: str, timeout: float = WAIT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agentbatch.cli", *args], text=True,
                          capture_output=True, timeout=timeout)


def _poll(handle: BatchHandle, until: Callable[[BatchProgress], bool]) -> BatchProgress:
    deadline = time.monotonic() + WAIT_S
    seen: BatchProgress | None = None
    while time.monotonic() < deadline:
        seen = handle.progress()
        if until(seen):
            return seen
        time.sleep(0.05)
    raise AssertionError(f"progress never reached the expected state; last: {seen}")


def _usd(value: float) -> str:
    return f"${value:,.4f}"


def _dollars(shown: str) -> float:
    return float(shown[1:].replace(",", ""))


def _run_held(redis_url: str, sim_url: str, prices: Any,
              while_held: Callable[[BatchHandle], None]) -> tuple[BatchHandle, BatchProgress]:
    """The two agents on one worker; ``while_held`` runs while agent 0 is in the gate and
    agent 1 has finished; returns the handle (open) and the final snapshot."""
    key = f"held:gate:{uuid.uuid4().hex}"
    client = redis.from_url(redis_url)
    handle = submit_batch(TASK, _inputs(redis_url, key), tools=[gate], model=MODEL,
                          backend=sim_url, max_retries=0, prices=prices, keep_transcript=True,
                          warm_prefix=False, redis_url=redis_url)
    try:
        _poll(handle, lambda p: p.awaiting_tools == 1 and p.done == 1)
        while_held(handle)
    finally:
        client.set(key, 1)
        client.close()
    results = handle.wait(timeout=WAIT_S)
    assert [r.ok for r in results] == [True, True], [r.error for r in results]
    return handle, _poll(handle, lambda p: p.finished)


def _watch(batch_id: str, redis_url: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "agentbatch.cli", "watch", batch_id, "--redis-url", redis_url,
         "--interval", "0.2", "--timeout", str(WAIT_S)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_status_watch_and_show_show_spend_and_projection(sim_url: str, redis_url: str,
                                                         start_workers) -> None:
    start_workers(1)
    seen: dict[str, Any] = {}
    watchers: list[subprocess.Popen[str]] = []

    def while_held(handle: BatchHandle) -> None:
        running = handle.progress()
        assert running.cost_usd is not None and running.cost_usd > 0, running
        assert running.projected_cost_usd is not None, running  # replies paid for: known
        assert running.projected_cost_usd > running.cost_usd, running  # agent 0 has turns left
        seen["status"] = _cli("status", handle.batch_id, "--redis-url", redis_url)
        # started on the running batch: its plain lines carry the spend as it goes; the
        # gate stays shut until it has printed one
        watchers.append(_watch(handle.batch_id, redis_url))
        assert watchers[0].stdout is not None
        seen["watch_line"] = watchers[0].stdout.readline()

    try:
        handle, final = _run_held(redis_url, sim_url, PRICES, while_held)
        [watcher] = watchers
        out, err = watcher.communicate(timeout=WAIT_S)
    finally:
        for w in watchers:
            if w.poll() is None:
                w.kill()
                w.wait(timeout=30)

    # status on the running batch: the spend so far and a projection past it
    status = seen["status"]
    assert status.returncode == 0, (status.stdout, status.stderr)
    assert "running" in status.stdout, status.stdout
    m = re.search(rf"cost: ({DOLLARS}) spent, ({DOLLARS}) projected to complete",
                  status.stdout)
    assert m is not None, status.stdout
    spent, projected = (_dollars(g) for g in m.groups())
    assert 0 < spent < projected, status.stdout

    # watch: a running line with the spend, then the final counts with the final spend
    assert watcher.returncode == 0, (out, err)
    line = seen["watch_line"]
    assert re.search(rf"1/2 finished: .*; cost: {DOLLARS} spent, {DOLLARS} projected", line), \
        (line, out, err)
    assert final.cost_usd is not None and final.cost_usd > spent
    done = (f"cost: {_usd(final.cost_usd)} spent, {_usd(final.cost_usd)} projected to "
            "complete")
    assert done in out, out
    assert final.budget_warning is None and "passes max_cost_usd" not in out

    # status once finished: the same final spend; show: one agent's spend
    after = _cli("status", handle.batch_id, "--redis-url", redis_url)
    assert after.returncode == 0 and done in after.stdout, (after.stdout, after.stderr)
    results = handle.wait(timeout=WAIT_S)
    for r in results:
        shown = _cli("show", handle.batch_id, str(r.index), "--redis-url", redis_url)
        assert shown.returncode == 0, (shown.stdout, shown.stderr)
        assert r.cost_usd is not None
        [agent] = re.findall(rf"{r.turns} turns · ({DOLLARS}) spent", shown.stdout)
        assert _dollars(agent) == pytest.approx(r.cost_usd, abs=1e-4), shown.stdout
    handle.close()


def test_without_prices_nothing_about_cost(sim_url: str, redis_url: str,
                                           start_workers) -> None:
    start_workers(1)
    seen: dict[str, subprocess.CompletedProcess[str]] = {}

    def while_held(handle: BatchHandle) -> None:
        assert handle.progress().cost_usd is None
        seen["running"] = _cli("status", handle.batch_id, "--redis-url", redis_url)

    handle, final = _run_held(redis_url, sim_url, None, while_held)
    assert final.cost_usd is None and final.projected_cost_usd is None
    outputs = [seen["running"],
               _cli("status", handle.batch_id, "--redis-url", redis_url),
               _cli("watch", handle.batch_id, "--redis-url", redis_url),
               _cli("show", handle.batch_id, "0", "--redis-url", redis_url)]
    handle.close()
    for proc in outputs:
        assert proc.returncode == 0, (proc.args, proc.stdout, proc.stderr)
        assert "cost" not in proc.stdout and "$" not in proc.stdout, (proc.args, proc.stdout)


@pytest.mark.parametrize("prices", [PRICES, None], ids=["prices", "no-prices"])
def test_run_batch_progress_shows_spend_only_with_prices(
        sim_url: str, monkeypatch: pytest.MonkeyPatch, prices: Any) -> None:
    buf = io.StringIO()
    monkeypatch.setattr(progress_display, "_stderr_console",
                        lambda: Console(file=buf, force_terminal=True, width=200))
    results = run_batch("Agent {i}.", [{"i": i} for i in range(3)], model=MODEL,
                        backend=sim_url, prices=prices, progress=True)
    assert [r.ok for r in results] == [True, True, True]
    shown = buf.getvalue()
    assert "3 done, 0 failed" in shown, shown
    if prices is None:
        assert "cost" not in shown and "$" not in shown, shown
        return
    total = sum(r.cost_usd or 0.0 for r in results)
    assert total > 0
    # the last frame drawn is the final snapshot: every agent's cost, nothing left to project
    frames = re.findall(rf"cost: ({DOLLARS}) spent, ({DOLLARS}) projected to complete", shown)
    assert frames, shown
    spent, projected = (_dollars(v) for v in frames[-1])
    assert spent == pytest.approx(total, abs=1e-4) and projected == spent, shown
