"""One error tree for the whole package.

Caller misuse is a ``BatchSpecError`` (a ``ValueError``) raised before anything is sent.
Everything that goes wrong *while an agent runs* becomes a structured ``AgentError`` on that
agent's result instead of an exception; the classes below are how the IO layers report
what happened so the agent core can decide what to do next.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from agentbatch.core.results import ErrorKind


class AgentBatchError(Exception):
    """Base of every error this package raises on purpose."""


class BatchSpecError(AgentBatchError, ValueError):
    """The batch as submitted cannot run; nothing was sent or enqueued."""

    def __init__(self, message: str, *, index: int | None = None) -> None:
        self.index = index
        super().__init__(f"input {index}: {message}" if index is not None else message)


class UnknownParameter(BatchSpecError, TypeError):
    """A keyword the function does not take: a ``TypeError``, as Python raises for any call."""


class BackendError(AgentBatchError):
    """A model call failed. ``retryable`` says whether the same request may succeed later."""

    kind: ClassVar[ErrorKind] = "backend"
    retryable = False

    def __init__(self, message: str, *, status: int | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after
        # HTTP attempts the call made before giving up (set by ``RetryingBackend``).
        self.attempts = 1


class BackendUnavailable(BackendError):
    """Connection refused, reset or DNS failure: the endpoint is not answering."""

    kind = "backend_unavailable"
    retryable = True


class ServerError(BackendError):
    """The server answered 5xx."""

    kind = "server_error"
    retryable = True


class RateLimited(BackendError):
    """The server answered 429 / throttling; honour ``retry_after`` when set."""

    kind = "rate_limited"
    retryable = True


class BackendTimeout(BackendError):
    """No complete answer within the per-turn timeout."""

    kind = "timeout"
    retryable = True


class BadRequest(BackendError):
    """The server rejected the request itself (4xx other than 429); retrying will not help."""

    kind = "bad_request"
    retryable = False


class ServerBusy(BackendError):
    """No capacity before the turn's deadline: the server's queue or the fleet's slots stayed
    full. Retryable: a later turn may find room."""

    kind = "server_busy"
    retryable = True


class BatchCancelled(AgentBatchError):
    """The batch was cancelled while a turn waited for capacity."""


class ConfigError(AgentBatchError, ValueError):
    """Configuration is missing or wrong (an API key, an extra that is not installed)."""


class ToolError(AgentBatchError):
    """Raised by a tool to report a failure whose message should reach the model verbatim."""


class BatchLost(AgentBatchError):
    """The batch's state is gone (e.g. Redis restarted without persistence)."""


class BatchExpired(AgentBatchError):
    """The batch finished and its keys were removed on purpose: after its retention
    (``AGENTBATCH_RETENTION_S``) or by ``handle.delete()`` / ``agentbatch rm``."""


class RedisOutOfMemory(AgentBatchError):
    """Redis refuses writes (``maxmemory`` reached with ``noeviction``): workers cannot commit
    and the batch is stalled until memory is freed. ``status`` holds the batch's counts."""

    def __init__(self, message: str, status: dict[str, int] | None = None) -> None:
        super().__init__(message)
        self.status = status or {}
