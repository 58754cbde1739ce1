"""Anthropic's Message Batches: ``POST /v1/messages/batches`` with ``{custom_id, params}``
requests, poll it, read the JSONL at its ``results_url`` and match lines by ``custom_id``.

Each request's shared prefix (tools, system prompt) is marked for the 1-hour prompt cache
(``cache_control: {"type": "ephemeral", "ttl": "1h"}``): a batch's requests run over minutes
to hours, and an agent's next turn comes a batch round later, so the default 5-minute cache
would have expired by then; Anthropic's batch docs recommend the 1-hour one for batches."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from agentbatch.backends.anthropic import ANTHROPIC_VERSION, AnthropicBackend
from agentbatch.backends.anthropic_convert import parse_response
from agentbatch.backends.http_session import HttpSession
from agentbatch.backends.provider_batch.client import (
    DEFAULT_TIMEOUT_S,
    PROBE_TIMEOUT_S,
    ProviderBatchClient,
)
from agentbatch.backends.provider_batch.http import answers, call
from agentbatch.backends.provider_batch.types import (
    BatchState,
    ItemError,
    ItemErrorKind,
    ItemResult,
)
from agentbatch.core.errors import ServerError
from agentbatch.core.model_io import ModelRequest

PATH = "/v1/messages/batches"
CACHE_TTL = "1h"  # the prompt cache's lifetime for batch turns (see above)
_RESULT_KINDS: dict[str, ItemErrorKind] = {"expired": "expired", "canceled": "cancelled"}
_ERROR_KINDS: dict[str, ItemErrorKind] = {
    "invalid_request_error": "bad_request", "authentication_error": "bad_request",
    "permission_error": "bad_request", "not_found_error": "bad_request",
    "request_too_large": "bad_request", "rate_limit_error": "rate_limited"}


class AnthropicBatchClient(ProviderBatchClient):
    """The Message Batches API of the server behind ``backend`` (its URL, key, bodies)."""

    quota_max_items = 100_000  # Message Batches: up to 100,000 requests (or 256 MB)

    def __init__(self, backend: AnthropicBackend, *,
                 timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.backend = backend
        self.name = f"{backend.name} batch"
        self.timeout = timeout
        key = backend._api_key
        self.session = HttpSession(backend.target.base_url, who=self.name, headers={
            "User-Agent": "agentbatch", "x-api-key": key,
            "anthropic-version": ANTHROPIC_VERSION}, timeout=timeout, max_connections=8,
            secret=key)

    async def discover(self) -> bool:
        return await answers(self.session, f"{PATH}?limit=1", PROBE_TIMEOUT_S)

    async def _submit(self, requests: Sequence[tuple[str, ModelRequest]]) -> BatchState:
        body = {"requests": [{"custom_id": cid,
                              "params": self.backend.build_body(req, cache_ttl=CACHE_TTL)}
                             for cid, req in requests]}
        return self._state((await call(self.session, "POST", PATH, timeout=self.timeout,
                                       json=body)).json())

    def _state(self, body: Any) -> BatchState:
        if not isinstance(body, dict) or not isinstance(body.get("id"), str):
            raise ServerError(f"{self.name}: a message batch without an id: {str(body)[:200]}",
                              status=200)
        status = str(body.get("processing_status"))
        found = body.get("request_counts")
        counts = found if isinstance(found, dict) else {}
        return BatchState(id=body["id"], status=status, ended=status == "ended",
                          counts={k: int(v) for k, v in counts.items() if isinstance(v, int)})

    async def _batch(self, batch_id: str) -> dict[str, Any]:
        return (await call(self.session, "GET", f"{PATH}/{batch_id}",
                           timeout=self.timeout)).json()

    async def state(self, batch_id: str) -> BatchState:
        return self._state(await self._batch(batch_id))

    async def cancel(self, batch_id: str) -> BatchState:
        return self._state((await call(self.session, "POST", f"{PATH}/{batch_id}/cancel",
                                       timeout=self.timeout)).json())

    def _item(self, line: dict[str, Any]) -> ItemResult:
        cid, result = line["custom_id"], line.get("result")
        kind = result.get("type") if isinstance(result, dict) else None
        if kind == "succeeded" and isinstance(result, dict):
            try:
                return ItemResult(cid, response=parse_response(result.get("message"),
                                                               who=self.name))
            except ServerError as exc:
                return ItemResult(cid, error=ItemError("server_error", str(exc)))
        if kind in _RESULT_KINDS:
            return ItemResult(cid, error=ItemError(_RESULT_KINDS[kind], f"{self.name}: the "
                                                   f"batch {kind} before this request ran"))
        err = result.get("error") if isinstance(result, dict) else None
        inner = err.get("error") if isinstance(err, dict) else None
        etype = inner.get("type") if isinstance(inner, dict) else None
        message = inner.get("message") if isinstance(inner, dict) else result
        return ItemResult(cid, error=ItemError(_ERROR_KINDS.get(str(etype), "server_error"),
                                               f"{self.name}: {etype}: {str(message)[:300]}"))

    async def _results(self, batch_id: str) -> dict[str, ItemResult]:
        url = (await self._batch(batch_id)).get("results_url")
        if not isinstance(url, str) or not url:
            raise ServerError(f"{self.name}: batch {batch_id} has no results_url yet",
                              status=200)
        # results_url is absolute; fetch its path from this server (the key goes nowhere else)
        parts = urlsplit(url)
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        resp = await call(self.session, "GET", path, timeout=self.timeout)
        out: dict[str, ItemResult] = {}
        for raw in resp.text.splitlines():
            try:
                line = json.loads(raw) if raw.strip() else None
            except ValueError:
                continue
            if isinstance(line, dict) and isinstance(line.get("custom_id"), str):
                out.setdefault(line["custom_id"], self._item(line))
        return out
