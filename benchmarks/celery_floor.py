"""The Celery floor: the distributed engine's task graph with every task a no-op.

Each agent is a chain of (turn, tool) x rounds + a final turn, alternating queues exactly as
the real engine does; each task only enqueues the next (with the same pipelined envelope
path). Workers: ``celery -A benchmarks.celery_floor worker -Q inference,tools -P threads``.
"""

from __future__ import annotations

import os

import redis

from agentbatch.workers.app import INFERENCE_QUEUE, TOOLS_QUEUE, make_app
from agentbatch.workers.dispatch import Followup, publish

app = make_app(os.environ.get("AGENTBATCH_REDIS_URL", "redis://127.0.0.1:6379/0"))
DONE_KEY = "floor:done"
# Under agentbatch's name: make_app keeps only ``agentbatch.*`` tasks (a worker runs nothing
# else), and the floor must run with exactly the workers' configuration.
STEP_TASK = "agentbatch.floor.step"


def step_message(agent: int, remaining: int) -> Followup:
    """The next no-op task: odd steps are tool calls, even ones model turns."""
    queue = TOOLS_QUEUE if remaining % 2 == 0 else INFERENCE_QUEUE
    return Followup(STEP_TASK, (agent, remaining), queue, 9)


@app.task(name=STEP_TASK, bind=True)
def step(self, agent: int, remaining: int) -> None:
    if remaining <= 1:
        redis.from_url(self.app.conf.broker_url).incr(DONE_KEY)
        return
    publish(self.app, [step_message(agent, remaining - 1)])
