"""The simulator's provider batch jobs: when each request finishes, and what it answers.

A job's timeline is decided when it is created and read lazily (no background task): request
``i`` finishes ``batch_latency_s * exp(spread * N(0, 1))`` seconds after creation (a
log-normal around the median, seeded per job and request), and the job expires
``batch_expire_s`` after creation. Requests not finished by then are ``expired``; requests not
finished when the job is cancelled are ``canceled``. Per request, a line ``@simbatch fail`` in
its messages (or ``batch_failure_rate``) makes it fail; ``@simbatch hold`` makes it never
finish on its own (it can only expire or be cancelled). Answers come from the same scripted
model as ``/v1/chat/completions`` (``model.plan_chat``).
"""

from __future__ import annotations

import math
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from agentbatch.sim.config import SimConfig
from agentbatch.sim.model import completion_cost, plan_chat
from agentbatch.sim.script import Reply, content_text
from agentbatch.sim.tokens import count_tokens, render_chat

Outcome = Literal["processing", "succeeded", "errored", "expired", "canceled"]
DIRECTIVE = "@simbatch "


@dataclass
class Item:
    """One request of a job, answered at creation, delivered once ``ready_at`` has passed."""

    custom_id: str
    body: dict[str, Any]  # an OpenAI chat completion body
    ready_at: float  # time.monotonic() when it finishes; inf: held
    fail: bool
    reply: Reply
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Job:
    """One provider batch. ``kind`` is the API it was created through."""

    id: str
    kind: Literal["openai", "anthropic"]
    items: list[Item]
    created_wall: float
    created: float
    expires: float  # time.monotonic()
    cancelled: float | None = None
    meta: dict[str, Any] = field(default_factory=dict)  # API-specific fields, echoed back
    files: dict[str, str] = field(default_factory=dict)  # "output"/"error" -> file id

    def cut(self) -> float:
        """When the job stops taking answers: cancelled or expired, whichever came first."""
        return min(self.expires, self.cancelled) if self.cancelled is not None else self.expires

    def outcome(self, item: Item, now: float) -> Outcome:
        cut = self.cut()
        if item.ready_at <= min(now, cut):
            return "errored" if item.fail else "succeeded"
        if now < cut:
            return "processing"
        return "canceled" if self.cancelled is not None and self.cancelled <= self.expires \
            else "expired"

    def ended_at(self, now: float) -> float | None:
        """When every request had an outcome (monotonic time); None while some are open."""
        last = max((i.ready_at for i in self.items), default=self.created)
        end = min(last, self.cut())
        return end if end <= now else None

    def counts(self, now: float) -> dict[str, int]:
        out = dict.fromkeys(("processing", "succeeded", "errored", "expired", "canceled"), 0)
        for item in self.items:
            out[self.outcome(item, now)] += 1
        return out

    def wall(self, t: float) -> int:
        """A monotonic time as the unix seconds the APIs report."""
        return int(self.created_wall + (t - self.created))


def _directives(body: dict[str, Any]) -> set[str]:
    words: set[str] = set()
    for message in body.get("messages") or []:
        if isinstance(message, dict):
            for line in content_text(message.get("content")).splitlines():
                if line.strip().startswith(DIRECTIVE):
                    words.add(line.strip()[len(DIRECTIVE):].strip())
    return words


def _latency(config: SimConfig, rng: random.Random) -> float:
    return config.batch_latency_s * math.exp(config.batch_latency_spread * rng.gauss(0.0, 1.0))


def make_job(config: SimConfig, kind: Literal["openai", "anthropic"],
             requests: list[tuple[str, dict[str, Any]]], prefix: str) -> Job:
    """A job over ``(custom_id, chat body)`` pairs, its timeline and answers decided now."""
    job_id = f"{prefix}{uuid.uuid4().hex[:24]}"
    now = time.monotonic()
    items = []
    for n, (custom_id, body) in enumerate(requests):
        rng = random.Random(f"{config.seed}:{job_id}:{n}")
        words = _directives(body)
        held = "hold" in words
        fail = "fail" in words or rng.random() < config.batch_failure_rate
        plan = plan_chat(body)
        prompt = render_chat(body.get("messages") or [], body.get("tools"))
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        items.append(Item(
            custom_id=custom_id, body=body,
            ready_at=math.inf if held else now + _latency(config, rng), fail=fail,
            reply=plan.reply, prompt_tokens=count_tokens(prompt),
            completion_tokens=completion_cost(plan.script, plan.reply.cost_text, max_tokens)))
    return Job(id=job_id, kind=kind, items=items, created_wall=time.time(), created=now,
               expires=now + config.batch_expire_s)
