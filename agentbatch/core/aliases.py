"""Names users bring from other batch-agent libraries, and the agentbatch parameter each means.

``difflib`` alone suggests by spelling: ``max_concurrent`` looked like ``max_turns`` and
``max_agents`` like ``max_tokens``, both wrong in meaning. This table is consulted first, so an
unknown keyword that is a known synonym is pointed at the parameter that does the same thing.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

# name seen in BatchAgent / aurora-swarm / common usage -> agentbatch parameter
PARAMETER_ALIASES: dict[str, str] = {
    "max_concurrent": "max_inflight",
    "max_concurrency": "max_inflight",
    "concurrency": "max_inflight",
    "max_agents": "max_inflight",
    "max_parallel": "max_inflight",
    "max_workers": "max_inflight",
    "prompt": "task",
    "prompt_template": "task",
    "system": "system_prompt",
    "schema": "output_schema",
    "response_model": "output_schema",
    "timeout": "timeout_per_turn",
    "retries": "max_retries",
    "redis": "redis_url",
}


def suggest(name: str, known: Iterable[str]) -> str | None:
    """The parameter ``name`` most likely meant: its alias when the table has one (and the
    target is among ``known``), else the closest spelling, else None."""
    candidates = list(known)
    alias = PARAMETER_ALIASES.get(name)
    if alias is not None and alias in candidates:
        return alias
    close = difflib.get_close_matches(name, candidates, n=1)
    return close[0] if close else None
