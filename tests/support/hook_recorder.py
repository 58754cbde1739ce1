"""A vLLM driver that records every backend hook called on it (``test_backend_hooks.py``).

Each call appends ``"<pid> <hook>"`` to the file ``$AGENTBATCH_TEST_HOOK_LOG``, so calls made in
worker processes are seen too, then does what ``VLLMBackend`` does (the simulator answers
vLLM's ``/tokenize`` and ``/detokenize``). A worker started with
``AGENTBATCH_TEST_RECORD_HOOKS=1`` routes ``sim://`` to it as soon as it imports this module,
which it does to load ``Answer`` (the batch's output schema) before it opens the backend.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from agentbatch.backends.base import RetryListener, ServerLoad
from agentbatch.backends.registry import register_driver
from agentbatch.backends.vllm import VLLMBackend
from agentbatch.core.errors import BackendError
from agentbatch.core.model_io import Message, ModelRequest, ModelResponse

if TYPE_CHECKING:
    from agentbatch.backends.slot_placement import SlotPlacer
    from agentbatch.core.plan import BatchPlan

LOG_ENV = "AGENTBATCH_TEST_HOOK_LOG"
REGISTER_ENV = "AGENTBATCH_TEST_RECORD_HOOKS"
DRIVER = "tests.support.hook_recorder:RecordingBackend"
LEARNED_HINT = 4  # what ``inflight_hint`` says once ``learn_inflight_hint`` ran
PINNED_SLOTS = 2  # what ``pinned_slots`` says: the plan then names this endpoint


class Answer(BaseModel):
    summary: str


def record(hook: str) -> None:
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a") as f:
            f.write(f"{os.getpid()} {hook}\n")


def recorded(path: Path, *, by: int | None = None, not_by: int | None = None) -> set[str]:
    """The hooks recorded in ``path``: by process ``by`` only, or by all but ``not_by``."""
    if not path.exists():
        return set()
    rows = [line.split() for line in path.read_text().splitlines() if line.strip()]
    return {hook for who, hook in rows
            if (by is None or int(who) == by) and (not_by is None or int(who) != not_by)}


class RecordingBackend(VLLMBackend):
    """``VLLMBackend`` that records each hook; every declared hook is overridden here."""

    def __init__(self, target: Any, **kwargs: Any) -> None:
        super().__init__(target, **kwargs)
        self._learned = False

    async def preflight(self, plan: BatchPlan) -> None:
        record("preflight")
        await super().preflight(plan)

    async def warm(self, request: ModelRequest) -> None:
        record("warm")
        await super().warm(request)

    async def fetch_load(self) -> ServerLoad | None:
        record("fetch_load")
        return await super().fetch_load()

    @property
    def inflight_hint(self) -> int | None:
        record("inflight_hint")
        return LEARNED_HINT if self._learned else super().inflight_hint

    async def learn_inflight_hint(self) -> None:
        record("learn_inflight_hint")
        await super().learn_inflight_hint()
        self._learned = True

    async def save_conversation(self, agent_key: str) -> str | None:
        record("save_conversation")
        await super().save_conversation(agent_key)
        return "saved"  # as if saved, so that a pool goes on to ``restore_conversation``

    async def restore_conversation(self, agent_key: str, name: str) -> bool:
        record("restore_conversation")
        return await super().restore_conversation(agent_key, name)

    async def pinned_slots(self) -> int | None:
        record("pinned_slots")
        await super().pinned_slots()
        return PINNED_SLOTS  # as if pinned, so that a worker is handed the fleet's map

    def share_slots(self, placer: SlotPlacer) -> bool:
        record("share_slots")
        super().share_slots(placer)
        return True

    async def complete_batch(self, prompts: list[str], **kwargs: Any
                             ) -> list[ModelResponse | BackendError]:
        record("complete_batch")
        return await super().complete_batch(prompts, **kwargs)

    @property
    def batch_limit(self) -> int | None:
        record("batch_limit")
        return super().batch_limit

    async def health(self) -> bool:
        record("health")
        return await super().health()

    @property
    def listeners(self) -> list[RetryListener]:
        record("listeners")
        return super().listeners

    async def context_length(self) -> int | None:
        record("context_length")
        return await super().context_length()

    async def count_tokens(self, prompt: str | list[Message],
                           tools: list[dict[str, Any]] | None = None) -> int | None:
        record("count_tokens")
        return await super().count_tokens(prompt, tools)

    @property
    def requests_sent(self) -> int | None:
        record("requests_sent")
        return super().requests_sent

    @property
    def retries(self) -> int | None:
        record("retries")
        return super().retries


if os.environ.get(REGISTER_ENV) == "1":
    register_driver("sim", DRIVER)
