"""agentbatch's embedded engine (``arun_batch``) on a benchmark workload.

Defaults throughout, as a user would call it: ``vllm://`` backend (the same driver and
capabilities as ``sim://``), output schema sent natively as ``response_format``, shared prefix
warmed once, ``max_inflight`` at the backend's safe cap (256, above N=200: no cap in effect).
"""

from __future__ import annotations

from typing import Any

from benchmarks.peers import RunOutcome
from benchmarks.workloads import MODEL, SYSTEM_PROMPT, TOOL_NAME, ToolCounter, Workload, make_lookup

NAME = "agentbatch"
LABEL = "agentbatch embedded (arun_batch)"


def settings(agents: int, **overrides: Any) -> dict[str, Any]:
    return {"backend": "vllm://HOST:PORT", "max_turns": "workload", **overrides}


async def run(
    base_url: str,
    workload: Workload,
    agents: int,
    counter: ToolCounter,
    **overrides: Any,
) -> RunOutcome:
    """Run ``agents`` agents of ``workload`` with ``arun_batch`` against base_url."""
    from agentbatch import Tool, arun_batch

    lookup = Tool(name=TOOL_NAME, fn=make_lookup(workload, counter),
                  cacheable=workload.cacheable)
    host_port = base_url.split("://", 1)[1].rstrip("/")
    results = await arun_batch(
        workload.task,
        workload.inputs(agents),
        system_prompt=SYSTEM_PROMPT,
        tools=[lookup],
        output_schema=workload.schema,
        model=MODEL,
        backend=f"vllm://{host_port}",
        max_turns=workload.max_turns,
        **overrides,
    )
    outcome = RunOutcome(agents=agents, ok=0, tool_calls=0, tool_calls_shared=0)
    for r in results:
        if r.ok and isinstance(r.output, workload.schema):
            outcome.ok += 1
        else:
            outcome.add_error(f"{r.error.kind}: {r.error.message}" if r.error else "no output")
        outcome.tool_calls += len(r.tool_calls)
        outcome.tool_calls_shared += sum(1 for c in r.tool_calls if c.cached or c.coalesced)
    outcome.extra["turns_reported"] = sum(r.turns for r in results)
    return outcome
