"""The public entry points: submit or run a batch, sync or async, embedded or distributed."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import BaseModel

from .errors import BatchSpecError
from .orchestrator.compile import compile_batch
from .orchestrator.embedded_handle import EmbeddedHandle
from .orchestrator.handle import BatchHandle
from .orchestrator.options import BatchOptions
from .results import AgentResult


def _options(
    task: str,
    inputs: Sequence[Any],
    *,
    system_prompt: str | None = None,
    tools: Sequence[Any] = (),
    output_schema: type[BaseModel] | None = None,
    model: str | None = None,
    backend: str | Sequence[str] | None = None,
    max_turns: int = 6,
    max_retries: int = 2,
    max_inflight: int | None = None,
    timeout_per_turn: float | None = 120.0,
    timeout_per_tool: float | None = 60.0,
    max_tokens: int | None = None,
    temperature: float | None = None,
    on_result: Callable[[AgentResult], Any] | None = None,
    redis_url: str | None = None,
    batch_id: str | None = None,
    checkpoint_dir: str | None = None,
    native_json_schema: bool = True,
    warm_prefix: bool = True,
    batch_prompting: bool = False,
    max_server_waiting: int | None = None,
) -> BatchOptions:
    """Collect the arguments; environment variables fill in what the call leaves out.

    Args:
        task: a ``str.format`` template rendered with each input dict.
        inputs: one dict per agent.
        system_prompt: shared by every agent (part of the cached prefix).
        tools: ``Tool`` objects, ``@tool`` functions, or "module:attr" import paths.
        output_schema: a Pydantic model class the final answer must validate against;
            None for free text.
        model: model name sent to the backend (env ``AGENTBATCH_MODEL``).
        backend: URL such as ``vllm://gpu-0:8000``, or a list of URLs
            (env ``AGENTBATCH_BACKEND``).
        max_turns: model turns an agent may take (repair turns not counted).
        max_retries: per agent, retries of failed model calls plus repair turns.
        max_inflight: inference requests in flight at once (default: the backend's safe cap).
        timeout_per_turn: seconds for one model call attempt.
        timeout_per_tool: seconds for one tool call.
        on_result: called with each result as it arrives; exceptions are logged, never raised.
        redis_url: selects the distributed engine (env ``AGENTBATCH_REDIS_URL``).
        batch_id: a caller-chosen id (default: random).
        checkpoint_dir: where the embedded engine checkpoints (reserved).
        native_json_schema: also send the schema as ``response_format`` where it can apply.
        warm_prefix: send the shared prefix once before the fan-out.
        batch_prompting: gather concurrent tool-free turns into one ``/v1/completions``
            request with a prompt list (rendered with a ChatML template).
        max_server_waiting: hold new model calls while the server's ``/metrics`` shows more
            waiting requests than this (backpressure; None: off).
    """
    model = model or os.environ.get("AGENTBATCH_MODEL")
    backend = backend or os.environ.get("AGENTBATCH_BACKEND")
    if not model:
        raise BatchSpecError("model is required (or set AGENTBATCH_MODEL)")
    if not backend:
        raise BatchSpecError("backend is required, e.g. 'vllm://host:8000' (or AGENTBATCH_BACKEND)")
    return BatchOptions(
        task=task, inputs=inputs, model=model, backend=backend, system_prompt=system_prompt,
        tools=tools, output_schema=output_schema, max_turns=max_turns, max_retries=max_retries,
        max_inflight=max_inflight, timeout_per_turn=timeout_per_turn,
        timeout_per_tool=timeout_per_tool, max_tokens=max_tokens, temperature=temperature,
        on_result=on_result, redis_url=redis_url or os.environ.get("AGENTBATCH_REDIS_URL"),
        batch_id=batch_id, checkpoint_dir=checkpoint_dir,
        native_json_schema=native_json_schema, warm_prefix=warm_prefix,
        batch_prompting=batch_prompting, max_server_waiting=max_server_waiting,
    )


def submit_batch(task: str, inputs: Sequence[Any], **kwargs: Any) -> BatchHandle:
    """Validate and start a batch; return a handle at once. See ``_options`` for arguments.

    Bad input raises ``ValueError`` (``BatchSpecError``) before anything is sent.
    """
    opts = _options(task, inputs, **kwargs)
    compiled = compile_batch(opts)
    if opts.redis_url:
        from .orchestrator.distributed_submit import submit_distributed

        return submit_distributed(compiled, opts)
    handle = EmbeddedHandle(compiled, opts)
    handle.start_threaded()
    return handle


async def asubmit_batch(task: str, inputs: Sequence[Any], **kwargs: Any) -> BatchHandle:
    """Async ``submit_batch``: the embedded engine runs on the caller's event loop."""
    opts = _options(task, inputs, **kwargs)
    compiled = compile_batch(opts)
    if opts.redis_url:
        import asyncio

        from .orchestrator.distributed_submit import submit_distributed

        return await asyncio.to_thread(submit_distributed, compiled, opts)
    handle = EmbeddedHandle(compiled, opts)
    await handle.start_in_loop()
    return handle


def run_batch(task: str, inputs: Sequence[Any], **kwargs: Any) -> list[AgentResult]:
    """Run a batch to the end; results in input order."""
    with submit_batch(task, inputs, **kwargs) as handle:
        return handle.wait()


async def arun_batch(task: str, inputs: Sequence[Any], **kwargs: Any) -> list[AgentResult]:
    """Async ``run_batch``."""
    handle = await asubmit_batch(task, inputs, **kwargs)
    async with handle:
        return await handle.wait_async()


def get_batch(batch_id: str, *, redis_url: str | None = None) -> BatchHandle:
    """Re-attach to a distributed batch from any process."""
    url = redis_url or os.environ.get("AGENTBATCH_REDIS_URL")
    if not url:
        raise BatchSpecError("get_batch needs redis_url (or AGENTBATCH_REDIS_URL)")
    from .orchestrator.distributed_submit import attach_distributed

    return attach_distributed(batch_id, url)
