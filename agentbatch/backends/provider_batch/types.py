"""What a provider batch client hands back: per-request results matched by ``custom_id``,
each a model reply or a structured error, never silent."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from agentbatch.core.model_io import ModelResponse

# Why one request of a provider batch has no reply.
ItemErrorKind = Literal[
    "server_error",  # the provider answered that request with a 5xx (partial failure)
    "rate_limited",  # ... with a 429
    "bad_request",  # ... with another 4xx, or the batch failed validation
    "expired",  # the batch passed its completion window before the request ran
    "cancelled",  # the batch was cancelled before the request ran
    "missing",  # the batch ended and neither result file names the request
]
# Kinds a caller may send again (to the sync API, or in a new batch): nothing was answered.
RETRYABLE: frozenset[str] = frozenset({"server_error", "rate_limited", "expired", "cancelled",
                                       "missing"})


@dataclass(frozen=True)
class ItemError:
    kind: ItemErrorKind
    message: str

    @property
    def retryable(self) -> bool:
        return self.kind in RETRYABLE


@dataclass(frozen=True)
class ItemResult:
    """One request's outcome: ``response`` or ``error``, exactly one of them set."""

    custom_id: str
    response: ModelResponse | None = None
    error: ItemError | None = None

    @property
    def ok(self) -> bool:
        return self.response is not None


@dataclass(frozen=True)
class BatchState:
    """A provider batch as last polled. ``status`` is the provider's own word."""

    id: str
    status: str
    ended: bool
    counts: dict[str, int] = field(default_factory=dict)
