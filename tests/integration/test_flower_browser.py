"""Flower in a real browser (issue 25, item 4).

``agentbatch flower`` (basic auth) against a real redis-server, an inference worker and a tool
worker, and a small batch with a tool call per agent. Through Flower's HTTP API: nothing is
served without the credentials, both workers are listed under their own node names, and
every agent's turns and tool calls are there. Then headless Chromium renders the tasks page
(Flower fills it client-side from its API) and the rows read as a person needs them:
``agentbatch.turn batch=<id> agent=<i> turn=<n> version=<v>``.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentbatch import submit_batch
from agentbatch.distributed.workers.app import TOOL_TASK, TURN_TASK
from agentbatch.sim.server import SimServer
from tests.integration.test_flower import _poll
from tests.integration.test_flower_cli import Flower, _env
from tests.support.redis_server import RedisServer
from tests.support.tools import lookup
from tests.support.workers import REPO, WorkerProcess

pytestmark = [pytest.mark.redis, pytest.mark.slow]

AGENTS = 4
USER, PASSWORD = "ops", "flower-browser-pw-5d1e"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Flags for a headless run that talks to nothing but the page asked for.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--hide-scrollbars",
                  "--window-size=1600,1000"]
# named args as the tasks page shows them (agentbatch/distributed/workers/envelope.py: args_repr)
TURN_ROW = re.compile(r"batch=(\w+) agent=(\d+) turn=(\d+) version=(\d+)")
TOOL_ROW = re.compile(r"batch=(\w+) agent=(\d+) tool=(\w+) version=(\d+) call=\S+ calls=(\d+)")


@dataclass
class Stack:
    redis: RedisServer
    inference: WorkerProcess
    tools: WorkerProcess
    flower: Flower
    batch_id: str

    def api(self, path: str, **params: Any) -> Any:
        reply = httpx.get(self.flower.url + path, params=params, auth=(USER, PASSWORD),
                          timeout=30)
        reply.raise_for_status()
        return reply.json()

    def diagnostics(self) -> str:
        return (f"--- flower ---\n{self.flower.log()[-2000:]}\n"
                f"--- inference worker ---\n{self.inference.log()[-1500:]}\n"
                f"--- tool worker ---\n{self.tools.log()[-1500:]}")


def _node(worker: WorkerProcess) -> str:
    """The node-name prefix WorkerProcess gives (``--hostname NAME-PID@%h``)."""
    return f"{worker.name}-{os.getpid()}@"


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    """redis-server, one worker per pool, ``agentbatch flower --basic-auth``, and one batch
    run to the end after Flower listens (task events reach only a subscribed Flower)."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not installed (.ci/run installs it)")
    redis_server = RedisServer().start()
    workers: list[WorkerProcess] = []
    flower = None
    try:
        with SimServer(fixed_ms=5) as sim:
            inference = WorkerProcess(redis_server.url, queues="inference", concurrency=4,
                                      name="inference")
            tools = WorkerProcess(redis_server.url, queues="tools", concurrency=4,
                                  name="tools", env={"TEST_TOOL_SLEEP_S": "0.05"})
            workers = [inference.start(wait=False), tools.start(wait=False)]
            for worker in workers:
                worker.wait_ready()
            flower = Flower(["--basic-auth", f"{USER}:{PASSWORD}"], _env(redis_server.url))
            partial = Stack(redis_server, inference, tools, flower, batch_id="")

            def both_alive() -> bool:
                alive = partial.api("/api/workers", status="1")
                return all(any(n.startswith(_node(w)) and up for n, up in alive.items())
                           for w in workers)

            _poll("both workers' heartbeats to reach Flower", both_alive,
                  on_timeout=partial.diagnostics)
            backend = "sim://" + sim.url.split("://", 1)[1]
            handle = submit_batch('Agent {i}.\n@sim tool lookup {{"key": "k{i}"}}',
                                  [{"i": i} for i in range(AGENTS)], model="m",
                                  backend=backend, tools=[lookup], redis_url=redis_server.url)
            results = handle.wait(timeout=120)
            assert [r.index for r in results] == list(range(AGENTS))
            assert all(r.ok for r in results), [r.error for r in results if not r.ok]
            partial.batch_id = handle.batch_id
            yield partial
    finally:
        if flower is not None:
            flower.stop()
        for worker in workers:
            worker.stop(timeout=15)
            worker.log_path.unlink(missing_ok=True)
        redis_server.cleanup()


def _tasks_by_agent(stack: Stack, task_name: str, row: re.Pattern[str]) -> dict[int, list[str]]:
    """Flower's finished ``task_name`` tasks of this batch, their shown args per agent."""
    found: dict[int, list[str]] = {}
    for task in stack.api("/api/tasks", taskname=task_name, state="SUCCESS").values():
        match = row.fullmatch(task["args"])
        assert match, f"{task_name} args not named: {task['args']!r}"
        if match.group(1) == stack.batch_id:
            found.setdefault(int(match.group(2)), []).append(task["worker"])
    return found


def test_the_api_refuses_requests_without_credentials(stack):
    for path in ("/api/workers", "/api/tasks", "/api/task/types", "/api/queues/length",
                 "/tasks", "/workers"):
        reply = httpx.get(stack.flower.url + path, timeout=30)
        assert reply.status_code == 401, (path, reply.status_code)
        assert stack.batch_id not in reply.text
        wrong = httpx.get(stack.flower.url + path, auth=(USER, "not-it"), timeout=30)
        assert wrong.status_code == 401, (path, wrong.status_code)


def test_both_workers_and_every_agents_tasks_are_listed_by_name(stack):
    alive = stack.api("/api/workers", status="1")
    nodes = {w.name: [n for n in alive if n.startswith(_node(w))]
             for w in (stack.inference, stack.tools)}
    assert all(len(names) == 1 for names in nodes.values()), (nodes, alive)
    inference_node, tool_node = nodes["inference"][0], nodes["tools"][0]
    assert inference_node != tool_node
    assert alive[inference_node] and alive[tool_node]

    def all_listed() -> tuple[dict[int, list[str]], dict[int, list[str]]] | None:
        turns = _tasks_by_agent(stack, TURN_TASK, TURN_ROW)
        tools = _tasks_by_agent(stack, TOOL_TASK, TOOL_ROW)
        everyone = set(range(AGENTS))
        return (turns, tools) if set(turns) == everyone and set(tools) == everyone else None

    turns, tools = _poll("Flower to list every agent's turns and tool calls", all_listed,
                         on_timeout=stack.diagnostics)
    # two model turns per agent (before and after its tool call), on the inference pool;
    # the tool call on the tool pool
    assert {i: len(nodes) for i, nodes in turns.items()} == {i: 2 for i in range(AGENTS)}
    assert {n for nodes in turns.values() for n in nodes} == {inference_node}
    assert {n for nodes in tools.values() for n in nodes} == {tool_node}
    # a person finds one agent's tasks with Flower's search, by the names they read
    one = stack.api("/api/tasks", search=f'args:"batch={stack.batch_id} agent=2 "')
    assert len(one) == 3 and {t["name"] for t in one.values()} == {TURN_TASK, TOOL_TASK}, one


def _chromium(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """One headless Chromium run with a fresh profile (removed after)."""
    if CHROMIUM is None:
        pytest.skip("chromium not installed (apt-get install chromium; .ci/run installs it)")
    profile = tempfile.mkdtemp(prefix="agentbatch-chromium-")
    try:
        return subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
                              capture_output=True, text=True, timeout=timeout)
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def test_the_tasks_page_in_chromium_names_batch_agent_and_turn(stack, tmp_path):
    # URL credentials: Chromium answers the page's and its API calls' 401 challenge with them
    page = f"http://{USER}:{PASSWORD}@127.0.0.1:{stack.flower.port}/tasks"

    def rendered_rows() -> str | None:
        # the table is filled by the page's script from /tasks/datatable: let it run
        out = _chromium("--virtual-time-budget=15000", "--dump-dom", page)
        assert out.returncode == 0, out.stderr[-2000:]
        dom = out.stdout
        return dom if f"batch={stack.batch_id} agent=" in dom else None

    dom = _poll("Chromium's rendering of the tasks page to show this batch's rows",
                rendered_rows, timeout=300, on_timeout=stack.diagnostics)
    cells = re.findall(r"<td[^>]*>(.*?)</td>", dom, flags=re.S)
    shown_turns = [m.groups() for c in cells if (m := TURN_ROW.fullmatch(c.strip()))]
    assert TURN_TASK in dom and TOOL_TASK in dom
    agents = {int(agent) for batch, agent, _, _ in shown_turns if batch == stack.batch_id}
    assert agents == set(range(AGENTS)), shown_turns
    assert {int(turn) for _, _, turn, _ in shown_turns} == {1, 2}, shown_turns

    shot = tmp_path / "flower-tasks.png"
    out = _chromium(f"--screenshot={shot}", "--virtual-time-budget=15000", page)
    assert out.returncode == 0 and shot.exists(), out.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    keep = os.environ.get("FLOWER_SCREENSHOT_DIR")  # to look at it: set this to a directory
    if keep:
        shutil.copy(shot, Path(keep) / shot.name)


def test_a_port_in_use_is_named_and_nothing_starts():
    """Before: exit 1 and a traceback ending in ``OSError: [Errno 98] Address already in
    use``, no port named."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # the check comes before Redis is reached: no server is needed behind this URL
        out = subprocess.run([sys.executable, "-m", "agentbatch.cli", "flower", "--port",
                              str(port), "--basic-auth", f"{USER}:{PASSWORD}"],
                             env=_env("redis://127.0.0.1:1/0"), cwd=REPO,
                             capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert f"port {port} on 127.0.0.1 is already in use" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "--port" in out.stderr, out.stderr
