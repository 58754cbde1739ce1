"""A tool that reports whether a secret is visible to tools through the worker's environment
(``os.environ`` and a subprocess's inherited environment), for the Redis URL tests."""

from __future__ import annotations

import os
import subprocess

from agentbatch import ToolError, tool


@tool
def environ_leak(needle: str) -> str:
    """"absent", or a ``ToolError`` naming where ``needle`` appears in the environment
    (the call record keeps ``ok`` but not the text, so the failure is the signal).

    Args:
        needle: the text to look for (e.g. the Redis password).
    """
    where = [name for name, value in os.environ.items() if needle in value]
    child = subprocess.run(["env"], capture_output=True, text=True, timeout=30).stdout
    if needle in child:
        where.append("(child process)")
    if where:
        raise ToolError(f"found in {', '.join(where)}")
    return "absent"
