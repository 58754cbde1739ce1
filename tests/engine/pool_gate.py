"""A tool that holds agents between two turns, across processes: the distributed pool fault
test's gate (``test_engine_pool_distributed.py``).

The embedded test's gate is a ``threading.Event`` in the test process; on the distributed
engine the tool runs in a worker process, so the gate is a directory named by
``POOL_GATE_DIR`` in the worker's environment: the tool writes ``arrived-<agent>`` there,
then waits for ``go`` (or, for the agent named in ``late``, for ``go-late``). Workers import
this module (``AGENTBATCH_WORKER_IMPORTS``).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from agentbatch import tool
from agentbatch.core.tool_context import ToolContext

GATE_ENV = "POOL_GATE_DIR"
WAIT_S = 600.0  # a gate never waits forever


class Note(BaseModel):
    note: str = Field(max_length=30)


@tool
async def hold_gate(step: Literal["ready"], ctx: ToolContext) -> str:
    """Wait for the go-ahead.

    Args:
        step: always "ready".
    """
    gate = Path(os.environ[GATE_ENV])
    (gate / f"arrived-{ctx.agent_index}").touch()
    late = gate / "late"
    is_late = late.exists() and late.read_text().strip() == str(ctx.agent_index)
    go = gate / ("go-late" if is_late else "go")
    deadline = time.monotonic() + WAIT_S
    while not go.exists():
        if time.monotonic() > deadline:
            raise RuntimeError("the test never opened the gate")
        await asyncio.sleep(0.05)
    return "go"
