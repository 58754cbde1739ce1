"""How a turn's prompt is sized: the shared prefix is counted by the server once, not every
turn. Before, a schema-heavy system prompt pushed the byte bound of nearly every llama.cpp
turn over the slot's context, and each such turn cost two extra requests (/apply-template,
/tokenize): the engine's batch-prompting test saw 48 requests for 20 agents."""

from __future__ import annotations

from typing import Any

from agentbatch.core.model_io import Message
from agentbatch.turnloop.context_fit import measure
from tests.support.fake_backend import ScriptedBackend


class CountingBackend(ScriptedBackend):
    """Counts a prompt as one token per 4 chars of its JSON, and records every count asked."""

    def __init__(self, name: str) -> None:
        super().__init__(name=name)  # prefix counts are cached per backend name and process
        self.counted: list[int] = []

    async def count_tokens(self, prompt: str | list[Message],
                           tools: list[dict[str, Any]] | None = None) -> int | None:
        self.counted.append(len(prompt) if isinstance(prompt, list) else 1)
        return len(str(prompt)) // 4 + (len(str(tools)) // 4 if tools else 0)


SYSTEM: Message = {"role": "system", "content": "Answer in the schema. " * 60}  # ~1.3 KB


def agent(i: int) -> list[Message]:
    return [SYSTEM, {"role": "user", "content": f"Question {i}: is a kettle a teapot?"}]


async def test_the_shared_prefix_is_counted_once_for_every_agent() -> None:
    backend = CountingBackend("once")
    limit = 600  # under the byte bound of the prompt, above prefix count + the rest's bytes
    sizes = [await measure(backend, agent(i), [], limit) for i in range(20)]
    assert backend.counted == [1]  # the system message alone, once
    assert all(how == "estimated" and size <= limit for size, how in sizes)


async def test_a_prompt_near_the_limit_is_counted_whole() -> None:
    backend = CountingBackend("near")
    long: list[Message] = [SYSTEM, {"role": "user", "content": "x" * 2000}]
    size, how = await measure(backend, long, [], 600)
    assert how == "counted" and backend.counted == [1, 2]  # the prefix, then the whole prompt
    assert size > 600


async def test_without_a_system_message_nothing_is_cached() -> None:
    backend = CountingBackend("nosystem")
    for i in range(3):
        await measure(backend, [{"role": "user", "content": "y" * 800 + str(i)}], [], 100)
    assert backend.counted == [1, 1, 1]  # each whole prompt, no prefix to share
