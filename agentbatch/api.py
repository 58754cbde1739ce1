"""The public entry points: submit or run a batch, sync or async, embedded or distributed.

The four batch functions take the same parameters. ``_batch_options`` declares them once
(types, defaults and the ``Args`` docs); ``_batch_function`` gives each public function that
signature: to type checkers and IDEs through ``ParamSpec``, to ``help()`` and ``inspect``
through ``__signature__`` and ``__doc__``.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import logging
import os
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from typing import Any, ParamSpec, TypeVar, cast

from pydantic import BaseModel

from .errors import BatchSpecError, UnknownParameter
from .orchestrator.compile import compile_batch
from .orchestrator.embedded_handle import EmbeddedHandle
from .orchestrator.handle import BatchHandle
from .orchestrator.options import (
    DEFAULT_MAX_TOOL_CALLS_PER_TURN,
    DEFAULT_MAX_TOOL_OUTPUT_CHARS,
    BatchOptions,
)
from .results import AgentResult
from .toolpool import Tool

log = logging.getLogger("agentbatch")
P = ParamSpec("P")
R = TypeVar("R")


def _batch_options(
    task: str,
    inputs: Iterable[Mapping[str, Any] | BaseModel],
    *,
    system_prompt: str | None = None,
    tools: Sequence[Tool | str] | Tool | str | None = (),
    output_schema: type[BaseModel] | None = None,
    model: str | None = None,
    backend: str | Sequence[str] | None = None,
    max_turns: int = 6,
    max_retries: int = 2,
    max_inflight: int | None = None,
    max_tool_calls_per_turn: int = DEFAULT_MAX_TOOL_CALLS_PER_TURN,
    max_tool_output_chars: int = DEFAULT_MAX_TOOL_OUTPUT_CHARS,
    timeout_per_turn: float | None = 120.0,
    timeout_per_tool: float | None = 60.0,
    max_tokens: int | None = None,
    temperature: float | None = None,
    on_result: Callable[[AgentResult], object] | None = None,
    redis_url: str | None = None,
    batch_id: str | None = None,
    checkpoint_dir: str | None = None,
    native_json_schema: bool = True,
    warm_prefix: bool = True,
    batch_prompting: bool = False,
    max_server_waiting: int | None = None,
    tool_calling: str = "native",
    tool_choice: str = "auto",
) -> BatchOptions:
    """Collect the arguments; environment variables fill in what the call leaves out.

    Args:
        task: a ``str.format`` template rendered with each input dict.
        inputs: one dict (or Pydantic model) per agent; keys are strings, values plain JSON.
        system_prompt: shared by every agent (part of the cached prefix).
        tools: ``@tool`` functions (defined at module level) or "module:attr" import paths.
        output_schema: a Pydantic model class the final answer must validate against;
            None for free text.
        model: model name sent to the backend (env ``AGENTBATCH_MODEL``).
        backend: URL such as ``vllm://gpu-0:8000``, or a list of URLs
            (env ``AGENTBATCH_BACKEND``).
        max_turns: model turns an agent may take (repair turns not counted); >= 1.
        max_retries: per agent, retries of failed model calls plus repair turns; >= 0.
        max_inflight: inference requests in flight at once (default: the backend's safe cap).
        max_tool_calls_per_turn: tool calls run from one model reply; each call past it is
            answered with an error the model can read, and not run. >= 1.
        max_tool_output_chars: a tool's output (or error) longer than this is cut to it, the
            cut marked ``[... truncated N of M chars by agentbatch]`` for the model, before it
            is stored or sent; a tool's own ``max_output_chars`` overrides it. >= 1.
        timeout_per_turn: seconds for one model call attempt (finite, > 0; None: no limit).
        timeout_per_tool: seconds for one tool call (finite, > 0; None: no limit).
        max_tokens: completion token cap per model call (>= 1; None: server default).
        temperature: sampling temperature (finite, >= 0; None: server default).
        on_result: called with each result as it arrives; exceptions are logged, never raised.
        redis_url: selects the distributed engine (env ``AGENTBATCH_REDIS_URL``).
        batch_id: a caller-chosen id (default: random).
        checkpoint_dir: where the embedded engine checkpoints (reserved).
        native_json_schema: also send the schema as ``response_format`` where it can apply.
        warm_prefix: send the shared prefix once before the fan-out.
        batch_prompting: gather concurrent tool-free turns into one ``/v1/completions``
            request with a prompt list (rendered with the server's chat template on
            llama.cpp and vLLM, ChatML elsewhere).
        max_server_waiting: hold new model calls while the server's ``/metrics`` shows more
            waiting requests than this (backpressure; >= 0; None: off).
        tool_calling: how the model calls tools. ``"native"``: the server's tool-call API.
            ``"json"``: each turn is constrained by guided JSON to
            ``{"tool_calls": [{"name", "arguments"}, ...]}`` or ``{"final": <answer>}``
            (no native tools sent; for servers or templates without reliable tool calls).
            ``"auto"``: json when a backend cannot force a native tool call (llama.cpp).
        tool_choice: ``"auto"``: the model decides each turn. ``"required"``: an agent must
            call a tool before its final answer (every turn until its first tool results
            is a tool call). In json mode the turn's schema allows only tool calls; in native
            mode a backend that does not enforce it is refused.

    Raises:
        BatchSpecError: a bad argument, named in the message (with the input index where
            one applies); nothing has been sent or enqueued. An unknown keyword raises
            ``UnknownParameter``, which is also a ``TypeError``.
    """
    model = model or os.environ.get("AGENTBATCH_MODEL")
    backend = backend or os.environ.get("AGENTBATCH_BACKEND")
    if not model:
        raise BatchSpecError("model is required (or set AGENTBATCH_MODEL)")
    if not backend:
        raise BatchSpecError("backend is required, e.g. 'vllm://host:8000' (or AGENTBATCH_BACKEND)")
    return BatchOptions(
        task=task, inputs=inputs, model=model, backend=backend, system_prompt=system_prompt,
        tools=tools or (), output_schema=output_schema, max_turns=max_turns,
        max_retries=max_retries, max_inflight=max_inflight,
        max_tool_calls_per_turn=max_tool_calls_per_turn,
        max_tool_output_chars=max_tool_output_chars, timeout_per_turn=timeout_per_turn,
        timeout_per_tool=timeout_per_tool, max_tokens=max_tokens, temperature=temperature,
        on_result=on_result, redis_url=redis_url or os.environ.get("AGENTBATCH_REDIS_URL"),
        batch_id=batch_id, checkpoint_dir=checkpoint_dir,
        native_json_schema=native_json_schema, warm_prefix=warm_prefix,
        batch_prompting=batch_prompting, max_server_waiting=max_server_waiting,
        tool_calling=tool_calling, tool_choice=tool_choice,
    )


_SIGNATURE = inspect.signature(_batch_options)
_ARGS_DOC = inspect.cleandoc(_batch_options.__doc__ or "").partition("\n\n")[2]


def _options_for(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> BatchOptions:
    """Bind a public call to the shared signature; unknown keywords get a close match."""
    for key in kwargs:
        if key not in _SIGNATURE.parameters:
            close = difflib.get_close_matches(key, list(_SIGNATURE.parameters), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise UnknownParameter(f"{name}() got an unexpected keyword argument {key!r}{hint}")
    try:
        _SIGNATURE.bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"{name}(): {exc}") from None
    return _batch_options(*args, **kwargs)


def _takes(params: Callable[P, BatchOptions]
           ) -> Callable[[Callable[[BatchOptions], R]], Callable[P, R]]:
    """Expose ``fn(opts)`` with the parameters of ``params`` (``_batch_options``) and their docs."""

    def decorate(fn: Callable[[BatchOptions], R]) -> Callable[P, R]:
        name = fn.__name__
        wrapper: Callable[..., Any]
        if inspect.iscoroutinefunction(fn):
            async_fn = cast(Callable[[BatchOptions], Coroutine[Any, Any, Any]], fn)

            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                return await async_fn(_options_for(name, args, kwargs))

            wrapper = async_wrapper
        else:

            def sync_wrapper(*args: Any, **kwargs: Any) -> Any:
                return fn(_options_for(name, args, kwargs))

            wrapper = sync_wrapper
        functools.update_wrapper(wrapper, fn)
        del wrapper.__wrapped__  # inspect must report __signature__, not fn's (opts)
        wrapper.__signature__ = inspect.signature(params).replace(  # type: ignore[attr-defined]
            return_annotation=inspect.signature(fn).return_annotation)
        wrapper.__doc__ = inspect.cleandoc(fn.__doc__ or "") + "\n\n" + _ARGS_DOC
        return cast(Callable[P, R], wrapper)

    return decorate


def _announce(handle: BatchHandle) -> BatchHandle:
    """One INFO line naming the engine: an exported AGENTBATCH_REDIS_URL picks it silently."""
    log.info("batch %s: %d agent(s) on the %s engine", handle.batch_id, handle.total,
             handle.runs_on)
    return handle


def _submit(opts: BatchOptions) -> BatchHandle:
    compiled = compile_batch(opts)
    if opts.redis_url:
        from .orchestrator.distributed_submit import submit_distributed

        return _announce(submit_distributed(compiled, opts))
    handle = EmbeddedHandle(compiled, opts)
    handle.start_threaded()
    return _announce(handle)


async def _asubmit(opts: BatchOptions) -> BatchHandle:
    compiled = compile_batch(opts)
    if opts.redis_url:
        import asyncio

        from .orchestrator.distributed_submit import submit_distributed

        return _announce(await asyncio.to_thread(submit_distributed, compiled, opts))
    handle = EmbeddedHandle(compiled, opts)
    await handle.start_in_loop()
    return _announce(handle)


@_takes(_batch_options)
def submit_batch(opts: BatchOptions) -> BatchHandle:
    """Validate and start a batch; return a handle at once."""
    return _submit(opts)


@_takes(_batch_options)
async def asubmit_batch(opts: BatchOptions) -> BatchHandle:
    """Async ``submit_batch``: the embedded engine runs on the caller's event loop."""
    return await _asubmit(opts)


@_takes(_batch_options)
def run_batch(opts: BatchOptions) -> list[AgentResult]:
    """Run a batch to the end; results in input order."""
    with _submit(opts) as handle:
        return handle.wait()


@_takes(_batch_options)
async def arun_batch(opts: BatchOptions) -> list[AgentResult]:
    """Async ``run_batch``."""
    handle = await _asubmit(opts)
    async with handle:
        return await handle.wait_async()


def get_batch(batch_id: str, *, redis_url: str | None = None) -> BatchHandle:
    """Re-attach to a distributed batch from any process."""
    from .orchestrator.validate import check_batch_id

    check_batch_id(batch_id)
    url = redis_url or os.environ.get("AGENTBATCH_REDIS_URL")
    if not url:
        raise BatchSpecError("get_batch needs redis_url (or AGENTBATCH_REDIS_URL)")
    from .orchestrator.distributed_submit import attach_distributed

    return attach_distributed(batch_id, url)
