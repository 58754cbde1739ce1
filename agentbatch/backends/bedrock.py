"""AWS Bedrock via the ``bedrock-runtime`` Converse API (boto3, imported only when used).

``bedrock://REGION[/MODEL]``: a model in the URL overrides ``request.model``. Credentials come
from boto3's usual chain (environment, profile, instance role). One client serves every call:
boto3 clients are thread-safe and creating one costs milliseconds of CPU and a config read.
botocore's own retries are off (``total_max_attempts=1``) because ``RetryingBackend`` retries, and
``AdaptiveBackend`` must *see* each throttle to shrink concurrency.

boto3 is synchronous, so calls run on a private thread pool sized like the connection pool:
the event loop's default executor (min(32, cpus+4) threads, shared with tools) would cap
concurrency silently on a small machine.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from agentbatch.backends.base import Backend, BackendCapabilities
from agentbatch.backends.bedrock_convert import DEFAULT_MAX_TOKENS, converse_params, parse_converse
from agentbatch.backends.http_errors import truncate
from agentbatch.backends.urls import BackendTarget, parse_backend_url
from agentbatch.core.errors import (
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    BadRequest,
    ConfigError,
    RateLimited,
    ServerError,
)
from agentbatch.core.model_io import ModelRequest, ModelResponse
from agentbatch.core.wait_for import wait_for

DEFAULT_TIMEOUT_S = 300.0
CONNECT_TIMEOUT_S = 10.0
MAX_POOL = 128

CAPABILITIES = BackendCapabilities(
    native_json_schema=False, prefix_warming=False, batch_prompting=False, max_safe_concurrency=16
)

_THROTTLES = {
    "ThrottlingException",
    "TooManyRequestsException",
    "ServiceUnavailableException",
    "ServiceQuotaExceededException",
}
_SERVER = {
    "InternalServerException",
    "ModelErrorException",
    "ModelNotReadyException",
    "ModelStreamErrorException",
}


def import_boto() -> tuple[Any, Any]:
    """``(boto3, botocore.config.Config)``, or ``ConfigError`` with the install hint."""
    try:
        import boto3  # type: ignore[import-untyped]
        from botocore.config import Config  # type: ignore[import-untyped]
    except ImportError:
        raise ConfigError(
            "the bedrock:// backend needs boto3: pip install 'agentbatch[bedrock]'"
        ) from None
    return boto3, Config


def map_boto_error(exc: Exception, who: str) -> BackendError:
    """A botocore failure as our ``BackendError`` (throttles are ``RateLimited``, retryable)."""
    from botocore.exceptions import (  # type: ignore[import-untyped]
        BotoCoreError,
        ClientError,
        ConnectTimeoutError,
        EndpointConnectionError,
        NoCredentialsError,
        ParamValidationError,
        ReadTimeoutError,
    )

    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        msg = f"{who}: {code or 'error'}: {truncate(str(err.get('Message') or exc))}"
        if code in _THROTTLES or status == 429:
            return RateLimited(msg, status=status)
        if code == "ModelTimeoutException" or status == 408:
            return BackendTimeout(msg, status=status)
        if code in _SERVER or (isinstance(status, int) and status >= 500):
            return ServerError(msg, status=status)
        return BadRequest(msg, status=status)
    detail = truncate(str(exc) or type(exc).__name__, 300)
    if isinstance(exc, ReadTimeoutError):
        return BackendTimeout(f"{who}: read timed out: {detail}")
    if isinstance(exc, ConnectTimeoutError | EndpointConnectionError):
        return BackendUnavailable(f"{who}: not answering: {detail}")
    if isinstance(exc, NoCredentialsError):
        return BadRequest(f"{who}: no AWS credentials found (environment, profile or role)")
    if isinstance(exc, ParamValidationError):
        return BadRequest(f"{who}: invalid Converse request: {detail}")
    if isinstance(exc, BotoCoreError):
        return BackendUnavailable(f"{who}: {type(exc).__name__}: {detail}")
    return ServerError(f"{who}: {type(exc).__name__}: {detail}")


class BedrockBackend(Backend):
    """``Backend`` over ``bedrock-runtime`` ``converse``."""

    requests_sent: int = 0  # converse calls made (the base hook, counted here)

    def __init__(
        self,
        target: BackendTarget | str,
        *,
        timeout: float | None = None,
        max_connections: int = 1000,
        api_key: str | None = None,  # unused: AWS credentials come from boto3's chain
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        client: Any = None,
    ) -> None:
        if isinstance(target, str):
            target = parse_backend_url(target)
        if target.scheme != "bedrock" or not target.region:
            raise ConfigError(f"BedrockBackend needs a bedrock://REGION URL, got {target.raw!r}")
        self._boto3, self._config_cls = import_boto()
        self.target = target
        self.name = target.display
        self.region = target.region
        self.capabilities = CAPABILITIES
        self.timeout = float(timeout) if timeout else DEFAULT_TIMEOUT_S
        self.default_max_tokens = default_max_tokens
        self.pool_size = max(1, min(max_connections, MAX_POOL))
        self.requests_sent = 0
        self._client = client
        self._client_lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        if client is None:
            self._check_credentials()

    def _check_credentials(self) -> None:
        """Fail before any agent is dispatched, not once per agent, when boto3's chain
        (environment, profile, SSO, container or instance role) finds no credentials."""
        session = self._boto3.session.Session(region_name=self.region)
        if session.get_credentials() is None:
            raise ConfigError(
                f"{self.name}: no AWS credentials found: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY or AWS_PROFILE, or run with an instance/task role")

    def __repr__(self) -> str:
        return f"BedrockBackend({self.name!r})"

    @property
    def client(self) -> Any:
        """The one ``bedrock-runtime`` client, created on first use (thread-safe)."""
        with self._client_lock:
            if self._client is None:
                config = self._config_cls(
                    read_timeout=self.timeout,
                    connect_timeout=min(self.timeout, CONNECT_TIMEOUT_S),
                    # NOT {"max_attempts": 1}: botocore reads that as one *retry* (2 tries).
                    retries={"total_max_attempts": 1, "mode": "standard"},
                    max_pool_connections=self.pool_size,
                    user_agent_extra="agentbatch",
                )
                session = self._boto3.session.Session(region_name=self.region)
                self._client = session.client("bedrock-runtime", config=config)
            return self._client

    def model_id(self, request: ModelRequest) -> str:
        return self.target.model or request.model

    def build_params(self, request: ModelRequest) -> dict[str, Any]:
        """The ``converse`` keyword arguments (public so tests and tools can inspect them)."""
        return converse_params(
            request, model_id=self.model_id(request), default_max_tokens=self.default_max_tokens
        )

    def _call(self, params: dict[str, Any]) -> Any:
        return self.client.converse(**params)

    async def complete(self, request: ModelRequest) -> ModelResponse:
        """One model turn. Raises ``BackendError`` subclasses, never botocore exceptions."""
        if not self.model_id(request):
            raise BadRequest(f"{self.name}: no model: put it in the URL or the request")
        params = self.build_params(request)
        timeout = request.timeout_s or self.timeout
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                self.pool_size, thread_name_prefix="agentbatch-bedrock"
            )
        loop = asyncio.get_running_loop()
        self.requests_sent += 1
        try:
            reply = await wait_for(
                loop.run_in_executor(self._executor, self._call, params), timeout
            )
        except asyncio.TimeoutError:
            raise BackendTimeout(f"{self.name}: no answer within {timeout:g}s") from None
        except Exception as exc:
            raise map_boto_error(exc, self.name) from None
        return parse_converse(reply, who=self.name)

    async def aclose(self) -> None:
        """Stop the thread pool (running calls finish in the background) and the client."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
        client = self._client
        if client is not None and hasattr(client, "close"):
            client.close()
        self._client = None
