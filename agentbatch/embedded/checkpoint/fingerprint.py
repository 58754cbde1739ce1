"""What makes two runs "the same batch": a hash per part, so a mismatch can name the part.

The parts are the ones that decide what an agent does and what its result means: the task
template, the inputs, the system prompt, the tools' identities (import path + version, so an
edited tool is a different tool) and the output schema's JSON schema. The model, the backend
and the limits are not parts: a resumed batch may move to another server.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentbatch.core.model_io import canonical_json

PARTS = ("task", "inputs", "system_prompt", "tools", "output_schema")


def _hash(value: Any) -> str:
    return hashlib.sha256(canonical_json(value).encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Fingerprint:
    """One sha256 per part, plus the input count (shown when the inputs differ)."""

    parts: dict[str, str]
    inputs_count: int

    def differences(self, stored: dict[str, str], stored_count: int | None) -> list[str]:
        """The parts that differ from ``stored``, each as a phrase for an error message."""
        differ = []
        for name in PARTS:
            if stored.get(name) == self.parts[name]:
                continue
            if name == "inputs" and stored_count is not None:
                differ.append(f"the inputs ({self.inputs_count} now, {stored_count} in the "
                              "checkpoint" + (", same count but different values)"
                                              if stored_count == self.inputs_count else ")"))
            else:
                differ.append(f"the {name.replace('_', ' ')}")
        return differ


def batch_fingerprint(task: str, inputs: Sequence[dict[str, Any]], system_prompt: str | None,
                      tool_identities: Sequence[str], output_schema: dict[str, Any] | None
                      ) -> Fingerprint:
    """The fingerprint of a batch from its checked parts."""
    parts = {
        "task": _hash(task),
        "inputs": _hash(list(inputs)),
        "system_prompt": _hash(system_prompt),
        "tools": _hash(list(tool_identities)),
        "output_schema": _hash(output_schema),
    }
    return Fingerprint(parts=parts, inputs_count=len(inputs))
