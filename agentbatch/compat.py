"""A drop-in for BatchAgent 0.x users: ``from agentbatch.compat import BatchAgent, Tool``.

``BatchAgent.run`` / ``stream`` / ``run_with_reduce`` / ``run_with_map_reduce`` are async, as
in BatchAgent, and take its keyword names where they mean the same thing here:

=====================  =================================================================
BatchAgent             agentbatch
=====================  =================================================================
``max_concurrent``     ``max_inflight``
``max_agents``         ``max_inflight`` (agents in flight at once)
``Tool.define(...)``   ``@tool(...)`` (``Tool.define`` here builds the same ``Tool``)
``result.job_id``      ``result.index`` (``job_id`` is kept on results, as a string)
=====================  =================================================================

Every other keyword is agentbatch's own (``run_batch`` and the patterns). A BatchAgent
keyword with no equivalent (``runtime``, ``kvflow``, ...) raises ``BatchSpecError`` naming
it: it is never silently ignored. A keyword neither library knows raises ``UnknownParameter``.

Running someone's BatchAgent code elsewhere (a simulator, another server): set
``AGENTBATCH_COMPAT_BACKEND`` (and ``AGENTBATCH_COMPAT_MODEL``) to replace the backend URL
(and model names) the code names; unset, the code's own values are used.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from typing import Any

from agentbatch.api import arun_batch, asubmit_batch
from agentbatch.core.errors import BatchSpecError
from agentbatch.core.results import AgentResult
from agentbatch.toolpool import Tool as _Tool
from agentbatch.toolpool import tool

__all__ = ["BatchAgent", "BatchAgentResult", "Tool", "UNSUPPORTED", "RENAMED"]

BACKEND_ENV = "AGENTBATCH_COMPAT_BACKEND"
MODEL_ENV = "AGENTBATCH_COMPAT_MODEL"

RENAMED: dict[str, str] = {"max_concurrent": "max_inflight", "max_agents": "max_inflight"}
UNSUPPORTED: dict[str, str] = {
    "runtime": "agentbatch runs its own agent loop; external runtimes (OpenCode ...) are not "
               "supported",
    "kvflow": "there is no KVFlow prefetch; prefix caching is the server's (warm_prefix=True "
              "sends the shared prefix once where the server needs it)",
    "kvflow_advisor": "there is no KVFlow prefetch",
    "diff_kv": "there is no TokenDance diff KV",
    "prefix_pinning": "prefix caching is the server's; warm_prefix=True warms it",
    "priority": "scheduling is near-done-first, not caller-set priorities",
}
_MODEL_KEYS = ("model", "reduce_model", "planner_model", "worker_model", "reducer_model")
_BACKEND_KEYS = ("backend", "reduce_backend")


class BatchAgentResult(AgentResult):
    """An ``AgentResult`` that also answers BatchAgent's ``job_id``."""

    @property
    def job_id(self) -> str:
        return str(self.index)


def _result(r: AgentResult) -> BatchAgentResult:
    return BatchAgentResult.model_construct(**dict(r))  # keeps ``output``'s model instance


def _translate(kwargs: dict[str, Any], who: str) -> dict[str, Any]:
    """BatchAgent keywords to agentbatch ones; refuses what has no equivalent."""
    out = dict(kwargs)
    for name, reason in UNSUPPORTED.items():
        if name in out:
            raise BatchSpecError(f"BatchAgent.{who}: {name}= has no equivalent in agentbatch "
                                 f"({reason}); remove it")
    for old, new in RENAMED.items():
        if old in out:
            if new in out:
                raise BatchSpecError(f"BatchAgent.{who}: give {old}= or {new}=, not both "
                                     f"({old} is agentbatch's {new})")
            out[new] = out.pop(old)
    backend, model = os.environ.get(BACKEND_ENV), os.environ.get(MODEL_ENV)
    if backend:
        out.update({k: backend for k in _BACKEND_KEYS if out.get(k) is not None})
        out["backend"] = backend
    if model:
        out.update({k: model for k in _MODEL_KEYS if out.get(k) is not None})
        out["model"] = model
    return out


class BatchAgent:
    """BatchAgent's entry points over agentbatch (see the module docstring)."""

    @staticmethod
    async def run(**kwargs: Any) -> list[BatchAgentResult]:
        """``arun_batch``: every result, in input order."""
        return [_result(r) for r in await arun_batch(**_translate(kwargs, "run"))]

    @staticmethod
    async def stream(**kwargs: Any) -> AsyncIterator[BatchAgentResult]:
        """Each result as its agent finishes; leaving the loop early cancels the rest."""
        handle = await asubmit_batch(**_translate(kwargs, "stream"))
        async with handle:
            async for r in handle.aresults():
                yield _result(r)

    @staticmethod
    async def run_with_reduce(**kwargs: Any) -> tuple[list[BatchAgentResult], Any]:
        """``arun_with_reduce``: ``(results, reduced)``."""
        from agentbatch.patterns.reduce import arun_with_reduce

        results, reduced = await arun_with_reduce(**_translate(kwargs, "run_with_reduce"))
        return [_result(r) for r in results], reduced

    @staticmethod
    async def run_with_map_reduce(**kwargs: Any) -> tuple[list[BatchAgentResult], Any]:
        """``arun_with_map_reduce``: ``(map_results, reduced)``."""
        from agentbatch.patterns.map_reduce import arun_with_map_reduce

        results, reduced = await arun_with_map_reduce(
            **_translate(kwargs, "run_with_map_reduce"))
        return [_result(r) for r in results], reduced


class Tool(_Tool):
    """agentbatch's ``Tool`` (``Tool.read_file``, ``Tool.web_search``, ``Tool.http_get``) plus
    BatchAgent's ``Tool.define``."""

    @staticmethod
    def define(fn: Callable[..., Any] | None = None, /, *, name: str | None = None,
               description: str | None = None, cacheable: bool = False,
               rate_limit: float | None = None, timeout: float | None = None,
               **unsupported: Any) -> Any:
        """``@tool(...)``: ``Tool.define(fn, name=..., ...)`` or as a decorator. The function
        must be defined at module level for a distributed run's workers to import it."""
        if unsupported:
            raise BatchSpecError(f"Tool.define: {sorted(unsupported)[0]}= has no equivalent in "
                                 "agentbatch's @tool (it takes name, description, cacheable, "
                                 "rate_limit, timeout)")
        make = tool(name=name, description=description, cacheable=cacheable,
                    rate_limit=rate_limit, timeout=timeout)
        return make(fn) if fn is not None else make
