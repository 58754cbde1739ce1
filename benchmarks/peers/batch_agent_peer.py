"""The ``batch-agent`` package from PyPI (0.2.0, import name ``batch_agent``) on the same workload.

How it is pointed at the simulator, and why each setting is what it is (read from its source,
``batch_agent/__init__.py``, ``spec.py``, ``scheduler.py``, ``backends/vllm.py``):

* ``backend="vllm://HOST:PORT"`` selects ``VLLMBackend``, an OpenAI-compatible client over
  httpx (its own choice of library; it has no aiohttp option). We build the backend ourselves
  and pass it as ``runtime=`` only so we can close its httpx client after the run; the
  scheduler is the same one ``BatchAgent.run(backend=...)`` builds.
* ``max_turns``: its default is 1, which ends the agent right after the tool call; set to the
  workload's budget.
* ``max_inflight=agents``: its default (``max_concurrent=10``) caps in-flight model requests at
  10, which alone would make 200 agents take 40 forward passes. The simulator has unlimited
  concurrency, so the fair setting is no cap, as for the other systems.
* The output schema: batch-agent sends no ``response_format``/``guided_json``; it puts the
  schema as plain text (``Schema:\\n{...}``) in the system prompt. The simulator's scripted
  model only recognises a requested schema or a fenced ```json block, so unmodified it
  answers free text and every agent fails with ``OutputValidationError: model response did
  not contain a JSON object`` (then retries the whole agent after 1 s, 2 s, 4 s sleeps). The
  adapter therefore writes ``SCHEMA_INSTRUCTION`` + a fenced schema block into the system
  prompt itself; batch-agent sees its own instruction there and does not append a second
  copy (``TaskCompiler._build_prefix``). A real model would read the plain-text schema.
* Everything else is left at its defaults, including ``kvflow=True`` and
  ``streaming_tool_dispatch=True`` (model turns are streamed, SSE). With ``vllm://``,
  ``warm_prefix`` sends 1 warm-up chat request, POSTs ``/internal/pin_blocks`` (404 on the
  simulator, as on stock vLLM), scrapes ``/metrics`` and sends 4 more probe chat requests
  (prefix-sharing check), one after another, before the first agent starts; the KVFlow
  advisor POSTs ``/internal/prefetch`` (404) with a fresh ``httpx.AsyncClient`` whenever an
  agent enters TOOL_WAIT and every 500 ms. All of that is counted in its wall time and CPU,
  as it is part of ``BatchAgent.run``. ``kvflow=False`` is available as a variant.
"""

from __future__ import annotations

import json
from typing import Any

from benchmarks.peers import RunOutcome
from benchmarks.workloads import MODEL, SYSTEM_PROMPT, TOOL_NAME, ToolCounter, Workload, make_lookup

NAME = "batch_agent"
LABEL = "batch-agent 0.2.0 (PyPI)"


def settings(agents: int, **overrides: Any) -> dict[str, Any]:
    """The non-default ``BatchAgent.run`` settings used (for the result file)."""
    return {"backend": "vllm://HOST:PORT", "max_inflight": agents, "max_turns": "workload",
            "schema_in_system_prompt": "fenced ```json block (simulator workaround)", **overrides}


def system_prompt(workload: Workload) -> str:
    """The shared system prompt plus the schema in a form the simulator recognises."""
    from batch_agent.compiler import SCHEMA_INSTRUCTION

    schema = json.dumps(workload.schema.model_json_schema(), sort_keys=True)
    return f"{SYSTEM_PROMPT}\n\n{SCHEMA_INSTRUCTION}\nSchema:\n```json\n{schema}\n```"


async def run(
    base_url: str,
    workload: Workload,
    agents: int,
    counter: ToolCounter,
    **overrides: Any,
) -> RunOutcome:
    """Run ``agents`` agents of ``workload`` with ``BatchAgent.run`` against base_url."""
    from batch_agent import BatchAgent, Tool
    from batch_agent.backends.vllm import VLLMBackend

    lookup = Tool.define(make_lookup(workload, counter), name=TOOL_NAME,
                         cacheable=workload.cacheable)
    host_port = base_url.split("://", 1)[1].rstrip("/")
    backend = VLLMBackend.from_url(f"vllm://{host_port}")
    kwargs: dict[str, Any] = {
        "task": workload.task,
        "inputs": workload.inputs(agents),
        "system_prompt": system_prompt(workload),
        "tools": [lookup],
        "output_schema": workload.schema,
        "model": MODEL,
        "backend": f"vllm://{host_port}",
        "runtime": backend,
        "max_turns": workload.max_turns,
        "max_inflight": agents,
        **overrides,
    }
    try:
        results = await BatchAgent.run(**kwargs)
    finally:
        client = getattr(backend, "_client", None)
        if client is not None:
            await client.aclose()
    outcome = RunOutcome(agents=agents, ok=0)
    for r in results:
        if r.ok and isinstance(r.output, workload.schema):
            outcome.ok += 1
        else:
            outcome.add_error(f"{r.error.type}: {r.error.message}" if r.error else "no output")
    outcome.extra["attempts_total"] = sum(r.attempts for r in results)
    return outcome
