"""The Celery floor: the distributed engine's task graph with no agentbatch in it.

Each agent is a chain of (turn, tool) x rounds + a final turn, alternating queues exactly as
the real engine does; each task only enqueues the next (with the same pipelined envelope
path). With ``turn_s``/``tool_s`` of 0 the tasks are no-ops (what Celery alone costs per
task); with the workload's model latency and tool times, each task first sleeps as long in
its worker thread as the real turn or tool call waits (what Celery alone needs in wall time
to run the same work). Workers: ``celery -A benchmarks.celery_floor worker -P threads``.
"""

from __future__ import annotations

import os
import threading
import time

import httpx
import redis

from agentbatch.distributed.workers.app import INFERENCE_QUEUE, TOOLS_QUEUE, make_app
from agentbatch.distributed.workers.dispatch import Followup, publish

app = make_app(os.environ.get("AGENTBATCH_REDIS_URL", "redis://127.0.0.1:6379/0"))
DONE_KEY = "floor:done"
# Under agentbatch's name: make_app keeps only ``agentbatch.*`` tasks (a worker runs nothing
# else), and the floor must run with exactly the workers' configuration.
STEP_TASK = "agentbatch.floor.step"


def step_message(agent: int, remaining: int, waits: tuple[float, ...] = (),
                 model_url: str | None = None) -> Followup:
    """The next task: even ``remaining`` are tool calls, odd ones model turns; ``waits[i]`` is
    how long the task with ``remaining == i`` sleeps (none: a no-op). With ``model_url``, a
    model turn is instead one chat completion from that server (the simulator), over a
    keep-alive connection per worker thread: what a Celery app that only calls the model,
    keeping no agent state, pays for the call."""
    queue = TOOLS_QUEUE if remaining % 2 == 0 else INFERENCE_QUEUE
    return Followup(STEP_TASK, (agent, remaining, list(waits), model_url), queue, 9)


_clients = threading.local()
MODEL_BODY = {  # about the size of the workload's first turn: a system and a user message
    "model": "sim-model",
    "messages": [{"role": "system", "content": "You are a careful agent. Use the tools."},
                 {"role": "user", "content": "Agent 0. Look the keys up and answer."}],
    "tools": [{"type": "function", "function": {
        "name": "lookup", "description": "Look a key up.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}},
                       "required": ["key"]}}}],
}


def call_model(model_url: str) -> None:
    client = getattr(_clients, "client", None)
    if client is None:
        client = _clients.client = httpx.Client(base_url=model_url, timeout=60.0)
    client.post("/v1/chat/completions", json=MODEL_BODY).raise_for_status()


@app.task(name=STEP_TASK, bind=True)
def step(self, agent: int, remaining: int, waits: list[float] | None = None,
         model_url: str | None = None) -> None:
    if model_url and remaining % 2 == 1:
        call_model(model_url)
    elif waits and waits[remaining]:
        time.sleep(waits[remaining])
    if remaining <= 1:
        redis.from_url(self.app.conf.broker_url).incr(DONE_KEY)
        return
    publish(self.app, [step_message(agent, remaining - 1, tuple(waits or ()), model_url)])
