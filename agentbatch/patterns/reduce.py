"""Map a batch, then reduce its results with one agent, or with a tree of them.

The map stage is one ``run_batch``; each reduce level is another, whose agents each get one
rendered prompt (``reduce_prompt``). ``ReduceSpec.levels`` holds the whole reduce logic as a
generator that yields each level's prompts and receives that level's results, so the sync and
the async entry points are two thin drivers over the same steps. Both engines come for free:
the stages are ordinary batches. Embedded, this process drives them; distributed (``redis_url``)
the workers chain them (``pipeline_chain.py``) and this process only waits on the pipeline.
"""

from __future__ import annotations

import asyncio
import difflib
import os
from collections.abc import Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from agentbatch.api import arun_batch, run_batch
from agentbatch.core.errors import BatchSpecError, UnknownParameter
from agentbatch.core.results import AgentResult
from agentbatch.patterns.pipeline_error import PipelineError
from agentbatch.patterns.reduce_prompt import (
    CHARS_PER_TOKEN,
    check_fan_in,
    check_reduce_schema,
    check_reduce_template,
    estimate_tokens,
    render_reduce_prompt,
)

REDUCE_TASK = "{reduce_prompt}"  # each reduce agent's whole user message is its rendered prompt
# The run_batch options the reduce stages do not inherit from the map stage.
_MAP_ONLY = ("on_result", "output_schema", "batch_id")
_MAX_STAGE_SUFFIX = len(".reduce999")

Reduced = BaseModel | AgentResult
Step = tuple[int, list[str]]  # a reduce level: its number and one prompt per agent


@dataclass
class ReduceSpec:
    """Everything a reduce needs besides the map results; checked once, before any batch."""

    template: str
    schema: type[BaseModel]
    fan_in: int | None
    context_tokens: int | None
    kwargs: dict[str, Any]  # the run_batch options of the map stage, forwarded unchanged
    overrides: dict[str, Any] = field(default_factory=dict)  # model / backend / tools

    @classmethod
    def build(cls, reduce: Any, reduce_schema: Any, *, reduce_model: str | None,
              reduce_backend: str | Sequence[str] | None, reduce_tools: Any,
              reduce_fan_in: Any, reduce_context_tokens: Any,
              kwargs: dict[str, Any]) -> ReduceSpec:
        if reduce_context_tokens is not None and (
                isinstance(reduce_context_tokens, bool)
                or not isinstance(reduce_context_tokens, int) or reduce_context_tokens < 1):
            raise BatchSpecError(f"reduce_context_tokens must be an int >= 1 (the reduce "
                                 f"model's context length), got {reduce_context_tokens!r}")
        batch_id = kwargs.get("batch_id")
        if isinstance(batch_id, str) and len(batch_id) > 128 - _MAX_STAGE_SUFFIX:
            raise BatchSpecError(f"batch_id must be at most {128 - _MAX_STAGE_SUFFIX} "
                                 "characters here: each stage's batch id adds a suffix to it")
        overrides = {k: v for k, v in (("model", reduce_model), ("backend", reduce_backend),
                                       ("tools", reduce_tools)) if v is not None}
        misspelt = [k for k in kwargs if k.startswith("reduce")]
        if misspelt:
            known = [f"reduce_{n}" for n in ("model", "backend", "tools", "fan_in",
                                             "context_tokens")]
            close = difflib.get_close_matches(misspelt[0], known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise UnknownParameter(f"unexpected keyword argument {misspelt[0]!r}{hint}")
        return cls(check_reduce_template(reduce), check_reduce_schema(reduce_schema),
                   check_fan_in(reduce_fan_in), reduce_context_tokens, kwargs, overrides)

    def stage_kwargs(self, level: int) -> dict[str, Any]:
        """The reduce level's ``run_batch`` options: the map's, minus what only the map
        uses, with the reduce overrides and ``reduce_schema`` as the output schema."""
        kw = {k: v for k, v in self.kwargs.items() if k not in _MAP_ONLY}
        kw.update(self.overrides, output_schema=self.schema)
        if self.kwargs.get("batch_id"):
            kw["batch_id"] = f"{self.kwargs['batch_id']}.reduce{level}"
        return kw

    def _check_context(self, prompts: list[str], level: int, mapped: list[AgentResult]) -> None:
        """Refuse a prompt the reduce model cannot hold, rather than let it be cut."""
        if self.context_tokens is None:
            return
        reply = self.kwargs.get("max_tokens") or 0
        fixed = estimate_tokens(self.kwargs.get("system_prompt"),
                                str(self.schema.model_json_schema()))
        need = max(estimate_tokens(p) for p in prompts) + fixed + reply
        if need <= self.context_tokens:
            return
        fix = (f"pass a smaller reduce_fan_in (now {self.fan_in})" if self.fan_in
               else "pass reduce_fan_in=k to reduce in groups of k (a tree)")
        raise PipelineError(
            f"a level-{level} reduce prompt needs ~{need} tokens (estimated at "
            f"{CHARS_PER_TOKEN} chars per token, plus max_tokens={reply} for the reply), "
            f"more than reduce_context_tokens={self.context_tokens}; {fix}, or use a reduce "
            "model with a larger context. Nothing was truncated; the map results are on "
            "this error's .results", stage="reduce", results=mapped)

    def level_prompts(self, items: list[AgentResult], level: int,
                      mapped: list[AgentResult]) -> list[str]:
        """Level ``level``'s prompts over the previous level's results (the map's at 1): one
        per group of ``fan_in`` (all of them without one), checked against the context."""
        k = self.fan_in or max(len(items), 1)
        groups = [items[s:s + k] for s in range(0, len(items), k)] or [[]]
        prompts = [render_reduce_prompt(self.template, g, level=level) for g in groups]
        self._check_context(prompts, level, mapped)
        return prompts

    def levels(self, mapped: list[AgentResult]) -> Generator[Step, list[AgentResult], Reduced]:
        """Yield each level's prompts, receive its results; return ``reduced``."""
        items, level = mapped, 1
        while True:
            prompts = self.level_prompts(items, level, mapped)
            items = yield level, prompts
            if len(items) == 1:
                final = items[0]
                return final.output if final.ok else final
            level += 1


def _stage_inputs(prompts: list[str]) -> list[dict[str, str]]:
    return [{"reduce_prompt": p} for p in prompts]


def _failed_stage(exc: BatchSpecError, level: int, mapped: list[AgentResult]) -> PipelineError:
    return PipelineError(f"the level-{level} reduce batch was refused: {exc}", stage="reduce",
                         results=mapped)


def reduce_levels(spec: ReduceSpec, mapped: list[AgentResult]) -> Reduced:
    """Run every reduce level of ``spec`` over the map results; return ``reduced``."""
    levels = spec.levels(mapped)
    level, prompts = next(levels)
    while True:
        try:
            out = run_batch(REDUCE_TASK, _stage_inputs(prompts), **spec.stage_kwargs(level))
        except BatchSpecError as exc:
            raise _failed_stage(exc, level, mapped) from exc
        try:
            level, prompts = levels.send(out)
        except StopIteration as done:
            return done.value


async def areduce_levels(spec: ReduceSpec, mapped: list[AgentResult]) -> Reduced:
    """Async ``reduce_levels``."""
    levels = spec.levels(mapped)
    level, prompts = next(levels)
    while True:
        try:
            out = await arun_batch(REDUCE_TASK, _stage_inputs(prompts),
                                   **spec.stage_kwargs(level))
        except BatchSpecError as exc:
            raise _failed_stage(exc, level, mapped) from exc
        try:
            level, prompts = levels.send(out)
        except StopIteration as done:
            return done.value


def chained_url(kwargs: Mapping[str, Any]) -> str | None:
    """The Redis URL that makes a pattern distributed (and chained), or None (embedded)."""
    return kwargs.get("redis_url") or os.environ.get("AGENTBATCH_REDIS_URL") or None


def run_chained_reduce(task: str, inputs: Iterable[Any], spec: ReduceSpec, url: str
                       ) -> tuple[list[AgentResult], Reduced]:
    """The distributed ``run_with_reduce``: workers chain the stages (``pipeline_chain``);
    this process submits the map and waits on the pipeline, so dying loses nothing."""
    from agentbatch.patterns.pipeline_handle import new_pipeline_id, start_pipeline
    from agentbatch.patterns.pipeline_spec import PipelineSpec, check_pipeline_id, stage_spec

    pid = check_pipeline_id(new_pipeline_id(spec.kwargs.get("batch_id")))
    pipeline = PipelineSpec(pipeline_id=pid, map=stage_spec(task, spec.kwargs),
                            reduce=stage_spec(REDUCE_TASK, spec.stage_kwargs(1)),
                            reduce_template=spec.template, fan_in=spec.fan_in,
                            context_tokens=spec.context_tokens)
    on_result = spec.kwargs.get("on_result")
    extra = {"on_result": on_result} if on_result is not None else {}
    with start_pipeline(pipeline, task, list(inputs), url, **extra) as handle:
        return handle.wait()


def run_with_reduce(
    task: str,
    inputs: Iterable[Mapping[str, Any] | BaseModel],
    *,
    reduce: str,
    reduce_schema: type[BaseModel],
    reduce_model: str | None = None,
    reduce_backend: str | Sequence[str] | None = None,
    reduce_tools: Any = None,
    reduce_fan_in: int | None = None,
    reduce_context_tokens: int | None = None,
    **kwargs: Any,
) -> tuple[list[AgentResult], Reduced]:
    """Run a batch (the map), then reduce its results; return ``(results, reduced)``.

    ``task``, ``inputs`` and every other keyword are ``run_batch``'s and run the map stage
    (``redis_url`` makes every stage distributed). The reduce agent is one agent of a
    one-input batch with ``output_schema=reduce_schema``, the same options otherwise, except
    ``reduce_model`` / ``reduce_backend`` / ``reduce_tools`` when given (``reduce_tools=[]``
    for none); ``on_result`` sees map results only.

    Its prompt is the ``reduce`` template, with ``{n}``, ``{ok}``, ``{failed}`` and ``{level}``
    filled (no other field; ``{{``/``}}`` for literal braces), followed by every map output as
    JSON, one per line in input order, and every map failure's index, error kind and message.

    ``reduce_fan_in=k`` makes a tree: groups of k consecutive results are reduced in parallel
    (one batch per level) until one remains. Intermediate levels use ``reduce_schema`` too, so
    it must be able to summarise its own outputs; a failed group reaches the next level as a
    failure. ``reduce_context_tokens``: the reduce model's context length; a prompt estimated
    (chars / 4, plus ``max_tokens``) above it raises ``PipelineError`` before the reduce runs,
    naming ``reduce_fan_in``. Without it agentbatch cannot know the context: an over-long
    prompt is sent whole and the server's refusal ends the reduce agent. Never truncated.

    Returns:
        ``results``: the map results, in input order. ``reduced``: a ``reduce_schema``
        instance when the (final) reduce agent succeeded, else that agent's ``AgentResult``
        (``ok=False``, its ``error`` says why; ``input["reduce_prompt"]`` is its prompt).

    Raises:
        BatchSpecError: bad arguments, before anything is enqueued.
        PipelineError: the reduce could not run (context, refused reduce options); the map
            results are on its ``results``.
    """
    spec = ReduceSpec.build(reduce, reduce_schema, kwargs=kwargs, reduce_model=reduce_model,
                 reduce_backend=reduce_backend, reduce_tools=reduce_tools,
                 reduce_fan_in=reduce_fan_in, reduce_context_tokens=reduce_context_tokens)
    url = chained_url(kwargs)
    if url:
        return run_chained_reduce(task, inputs, spec, url)
    mapped = run_batch(task, inputs, **kwargs)
    return mapped, reduce_levels(spec, mapped)


async def arun_with_reduce(
    task: str,
    inputs: Iterable[Mapping[str, Any] | BaseModel],
    *,
    reduce: str,
    reduce_schema: type[BaseModel],
    reduce_model: str | None = None,
    reduce_backend: str | Sequence[str] | None = None,
    reduce_tools: Any = None,
    reduce_fan_in: int | None = None,
    reduce_context_tokens: int | None = None,
    **kwargs: Any,
) -> tuple[list[AgentResult], Reduced]:
    """Async ``run_with_reduce`` (same arguments, same contract for ``reduced``)."""
    spec = ReduceSpec.build(reduce, reduce_schema, kwargs=kwargs, reduce_model=reduce_model,
                 reduce_backend=reduce_backend, reduce_tools=reduce_tools,
                 reduce_fan_in=reduce_fan_in, reduce_context_tokens=reduce_context_tokens)
    url = chained_url(kwargs)
    if url:
        return await asyncio.to_thread(run_chained_reduce, task, inputs, spec, url)
    mapped = await arun_batch(task, inputs, **kwargs)
    return mapped, await areduce_levels(spec, mapped)
