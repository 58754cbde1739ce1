"""The cap on a tool's output: a tool may return 100 MB, and a prompt or a Redis value may not.

Uncapped, such an output was stored whole in Redis (~450 MB peak) and then refused by the
server (HTTP 413) on the agent's next model call. The pool cuts every output to the batch's
``max_tool_output_chars`` (or the tool's own ``max_output_chars``) before it is cached,
shared or stored, keeping the start and ending with a marker the model can read.
"""

from __future__ import annotations

from agentbatch.core.errors import BatchSpecError

DEFAULT_MAX_TOOL_OUTPUT_CHARS = 65_536
_MARKER = "\n[... truncated {dropped} of {total} chars by agentbatch]"


def cap_output(text: str, limit: int) -> str:
    """``text`` when it fits ``limit`` chars, else its start plus the marker, ``limit`` chars
    in all (just the marker when ``limit`` is shorter than it). Capping a capped text again
    with the same limit changes nothing."""
    total = len(text)
    if total <= limit:
        return text
    longest = len(_MARKER.format(dropped=total, total=total))
    keep = max(0, limit - longest)
    return text[:keep] + _MARKER.format(dropped=total - keep, total=total)


def check_limit(value: object, name: str) -> None:
    """A cap is a positive integer; anything else is refused naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BatchSpecError(f"{name} must be an integer >= 1, got {value!r}")
