"""Fault injection: scripted per-agent faults and seeded random chaos (pure: no IO, no clock).

Faults exist so the engine's retry, repair and timeout paths get exercised over real HTTP.
Scripted faults (``@sim fail``) make a specific agent fail deterministically; random faults
(``--fault-rate``) shake a whole batch, reproducibly for a given seed and request order.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

from agentbatch.core.model_io import canonical_json
from agentbatch.sim.script import EmittedCall, FailSpec, Reply, ToolCallSpec, tool_call_id

FAULT_KINDS = ("malformed_json", "bad_tool_call", "http_500", "http_429", "timeout")
HTTP_FAULTS = frozenset({"http_500", "http_429"})
# A truncated object after chatty prose: no JSON repair heuristic can recover a value from it.
MALFORMED_TEXT = 'Sure! Here it is: {"oops": '
UNKNOWN_TOOL = "no_such_tool"


@dataclass(frozen=True)
class Fault:
    """One fault to inject into the current request."""

    kind: str
    retry_after: str = "0"  # seconds, as sent in the Retry-After header (http_429 only)
    source: str = "script"  # "script" | "random"


def parse_fault_rates(spec: str | None) -> dict[str, float]:
    """Parse ``"http_500=0.1,http_429=0.05"`` into ``{"http_500": 0.1, "http_429": 0.05}``.

    Raises ``ValueError`` on unknown kinds, bad numbers, or rates that sum above 1.
    """
    rates: dict[str, float] = {}
    for part in (spec or "").split(","):
        part = part.strip()
        if not part:
            continue
        kind, sep, value = part.partition("=")
        kind = kind.strip()
        if not sep or kind not in FAULT_KINDS:
            raise ValueError(f"bad fault rate {part!r}; expected KIND=RATE, KIND in {FAULT_KINDS}")
        rate = float(value)
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"fault rate for {kind} must be in [0, 1], got {rate}")
        rates[kind] = rate
    if sum(rates.values()) > 1.0 + 1e-9:
        raise ValueError(f"fault rates sum to more than 1: {rates}")
    return rates


class FaultState:
    """Counts scripted-fault attempts per (agent key, directive) so each fires only N times.

    Fail directives apply in order: an agent with ``fail http_500`` then ``fail http_429``
    sees a 500 on its first request, a 429 on its second, then behaves.
    """

    def __init__(self) -> None:
        self._attempts: dict[tuple[str, int, str], int] = {}

    def next_fault(self, agent_key: str, fails: list[FailSpec]) -> Fault | None:
        for spec in fails:
            slot = (agent_key, spec.ordinal, spec.kind)
            used = self._attempts.get(slot, 0)
            if used < spec.times:
                self._attempts[slot] = used + 1
                return Fault(spec.kind, spec.retry_after, "script")
        return None

    def clear(self) -> None:
        self._attempts.clear()


class RandomFaults:
    """Seeded chaos: request number ``n`` draws the same fault for the same seed and rates."""

    def __init__(self, rates: dict[str, float], seed: int = 0, retry_after: str = "0") -> None:
        self._rates = sorted((k, v) for k, v in rates.items() if v > 0)
        self._seed = seed
        self._retry_after = retry_after

    def decide(self, n: int, sub: int = 0) -> Fault | None:
        """The fault for request ``n`` (``sub`` distinguishes prompts of one batch request)."""
        if not self._rates:
            return None
        tag = f"{self._seed}:{n}" if sub == 0 else f"{self._seed}:{n}:{sub}"
        u = int.from_bytes(hashlib.sha1(tag.encode()).digest()[:8], "big") / 2.0**64
        acc = 0.0
        for kind, rate in self._rates:
            acc += rate
            if u < acc:
                return Fault(kind, self._retry_after, "random")
        return None


def broken_arguments(arguments: str) -> str:
    """A proper prefix of a JSON object, which is never valid JSON itself."""
    return arguments[: max(1, len(arguments) // 2)]


def faulted_reply(kind: str, reply: Reply, pending: list[ToolCallSpec], agent_key: str) -> Reply:
    """Rewrite a chat reply for a content-level fault (``malformed_json`` / ``bad_tool_call``)."""
    if kind == "malformed_json":
        return Reply(content=MALFORMED_TEXT, tool_calls=[], finish_reason="stop")
    if kind == "bad_tool_call":
        if pending:
            name, args = pending[0].name, broken_arguments(pending[0].args_json)
        else:
            name, args = UNKNOWN_TOOL, canonical_json({})
        call_id = tool_call_id(agent_key + ":bad", name, args)
        return Reply(
            content=None, tool_calls=[EmittedCall(call_id, name, args)], finish_reason="tool_calls"
        )
    return replace(reply)


def faulted_text(kind: str, text: str) -> str:
    """Rewrite a plain-completion answer for a content-level fault (no tools exist there)."""
    if kind == "malformed_json":
        return MALFORMED_TEXT
    if kind == "bad_tool_call":
        return '{"path": '
    return text
