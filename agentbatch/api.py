"""The public entry points: submit or run a batch, sync or async, embedded or distributed.

The four batch functions take the same parameters: the fields of ``BatchOptions``
(``core/options.py`` declares each once, with its type, default and doc). ``_takes``
gives each public function that signature: to type checkers and IDEs through ``ParamSpec``
(the dataclass's ``__init__``), to ``help()`` and ``inspect`` through ``__signature__`` and
``__doc__``.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar, cast

from agentbatch.core.aliases import suggest
from agentbatch.core.errors import BatchSpecError, UnknownParameter
from agentbatch.core.options import BatchOptions, args_doc, with_environment
from agentbatch.core.results import AgentResult
from agentbatch.embedded.handle import EmbeddedHandle
from agentbatch.turnloop.compile import compile_batch
from agentbatch.turnloop.handle import BatchHandle

log = logging.getLogger("agentbatch")
P = ParamSpec("P")
R = TypeVar("R")
_SIGNATURE = inspect.signature(BatchOptions)
_RAISES = """Raises:
    BatchSpecError: a bad argument, named in the message (with the input index where one
        applies); nothing has been sent or enqueued. An unknown keyword raises
        ``UnknownParameter``, which is also a ``TypeError``."""


def _options_for(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> BatchOptions:
    """Bind a public call to ``BatchOptions``; unknown keywords get a close match."""
    for key in kwargs:
        if key not in _SIGNATURE.parameters:
            close = suggest(key, _SIGNATURE.parameters)
            hint = f"; did you mean {close!r}?" if close else ""
            raise UnknownParameter(f"{name}() got an unexpected keyword argument {key!r}{hint}")
    try:
        _SIGNATURE.bind(*args, **kwargs)
    except TypeError as exc:
        raise TypeError(f"{name}(): {exc}") from None
    return with_environment(BatchOptions(*args, **kwargs))


def _takes(params: Callable[P, BatchOptions]
           ) -> Callable[[Callable[[BatchOptions], R]], Callable[P, R]]:
    """Expose ``fn(opts)`` with the parameters of ``params`` (the ``BatchOptions`` class, so
    its fields) and their docs."""

    def decorate(fn: Callable[[BatchOptions], R]) -> Callable[P, R]:
        name = fn.__name__
        wrapper: Any  # a function that gets __signature__ and loses __wrapped__
        if inspect.iscoroutinefunction(fn):
            async_fn = fn

            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                return await async_fn(_options_for(name, args, kwargs))

            wrapper = async_wrapper
        else:

            def sync_wrapper(*args: Any, **kwargs: Any) -> Any:
                return fn(_options_for(name, args, kwargs))

            wrapper = sync_wrapper
        functools.update_wrapper(wrapper, fn)
        del wrapper.__wrapped__  # inspect must report __signature__, not fn's (opts)
        wrapper.__signature__ = inspect.signature(params).replace(
            return_annotation=inspect.signature(fn).return_annotation)
        wrapper.__doc__ = f"{inspect.cleandoc(fn.__doc__ or '')}\n\n{args_doc()}\n\n{_RAISES}"
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
        from agentbatch.distributed.submit import submit_distributed

        return _announce(submit_distributed(compiled, opts))
    handle = EmbeddedHandle(compiled, opts)
    handle.start_threaded()
    return _announce(handle)


async def _asubmit(opts: BatchOptions) -> BatchHandle:
    compiled = compile_batch(opts)
    if opts.redis_url:
        import asyncio

        from agentbatch.distributed.submit import submit_distributed

        return _announce(await asyncio.to_thread(submit_distributed, compiled, opts))
    handle = EmbeddedHandle(compiled, opts)
    await handle.start_in_loop()
    return _announce(handle)


@_takes(BatchOptions)
def submit_batch(opts: BatchOptions) -> BatchHandle:
    """Validate and start a batch; return a handle at once."""
    return _submit(opts)


@_takes(BatchOptions)
async def asubmit_batch(opts: BatchOptions) -> BatchHandle:
    """Async ``submit_batch``: the embedded engine runs on the caller's event loop."""
    return await _asubmit(opts)


@_takes(BatchOptions)
def run_batch(opts: BatchOptions) -> list[AgentResult]:
    """Run a batch to the end; results in input order."""
    from agentbatch.turnloop import progress_display

    show = progress_display.resolve(opts.progress)  # before anything is sent
    with _submit(opts) as handle:
        if show:
            return progress_display.show_while(handle, handle.wait)
        return handle.wait()


@_takes(BatchOptions)
async def arun_batch(opts: BatchOptions) -> list[AgentResult]:
    """Async ``run_batch``."""
    handle = await _asubmit(opts)
    async with handle:
        return await handle.wait_async()


def get_batch(batch_id: str, *, redis_url: str | None = None) -> BatchHandle:
    """Re-attach to a distributed batch from any process."""
    from agentbatch.turnloop.validate import check_batch_id

    check_batch_id(batch_id)
    url = redis_url or os.environ.get("AGENTBATCH_REDIS_URL")
    if not url:
        raise BatchSpecError("get_batch needs redis_url (or AGENTBATCH_REDIS_URL)")
    from agentbatch.distributed.submit import attach_distributed

    return attach_distributed(batch_id, url)
