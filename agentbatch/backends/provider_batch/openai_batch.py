"""OpenAI's Batch API: upload a JSONL file of ``{custom_id, method, url, body}`` lines to
``/v1/files``, create ``/v1/batches``, poll it, read the output and error files and match
their lines by ``custom_id``. Any server with those endpoints speaks it (``openai://``, the
simulator's ``sim://``); ``discover`` finds out which do.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from agentbatch.backends.http_session import HttpSession
from agentbatch.backends.openai_compat import OpenAICompatBackend
from agentbatch.backends.openai_parse import parse_chat_completion
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

CHAT_URL = "/v1/chat/completions"
ENDED = ("completed", "failed", "expired", "cancelled")
_LINE_ERRORS: dict[str, ItemErrorKind] = {"batch_expired": "expired",
                                          "batch_cancelled": "cancelled"}


def _status_kind(status: int) -> ItemErrorKind:
    if status == 429:
        return "rate_limited"
    return "server_error" if status >= 500 else "bad_request"


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line, ensure_ascii=False, allow_nan=False) + "\n"
                   for line in lines).encode()


class OpenAIBatchClient(ProviderBatchClient):
    """The Batch API of the server behind ``backend`` (its URL, key and request bodies)."""

    quota_max_items = 50_000  # the Batch API: up to 50,000 requests (or 200 MB) per file

    def __init__(self, backend: OpenAICompatBackend, *, timeout: float = DEFAULT_TIMEOUT_S,
                 completion_window: str = "24h") -> None:
        self.backend = backend
        self.name = f"{backend.name} batch"
        self.timeout = timeout
        self.completion_window = completion_window
        key = backend.target.api_key
        headers = {"User-Agent": "agentbatch"} | ({"Authorization": f"Bearer {key}"}
                                                  if key else {})
        self.session = HttpSession(backend.target.base_url, who=self.name, headers=headers,
                                   timeout=timeout, max_connections=8, secret=key)

    async def discover(self) -> bool:
        return await answers(self.session, "/v1/batches?limit=1", PROBE_TIMEOUT_S)

    def line(self, custom_id: str, request: ModelRequest) -> dict[str, Any]:
        body = self.backend.build_body(request)
        body.pop("stream", None)
        body.pop("stream_options", None)
        return {"custom_id": custom_id, "method": "POST", "url": CHAT_URL, "body": body}

    async def _submit(self, requests: Sequence[tuple[str, ModelRequest]]) -> BatchState:
        content = jsonl([self.line(cid, req) for cid, req in requests])
        upload = await call(self.session, "POST", "/v1/files", timeout=self.timeout,
                            data={"purpose": "batch"},
                            files={"file": ("agentbatch.jsonl", content, "application/jsonl")})
        file_id = upload.json()["id"]
        created = await call(self.session, "POST", "/v1/batches", timeout=self.timeout,
                             json={"input_file_id": file_id, "endpoint": CHAT_URL,
                                   "completion_window": self.completion_window})
        return self._state(created.json())

    def _state(self, body: Any) -> BatchState:
        if not isinstance(body, dict) or not isinstance(body.get("id"), str):
            raise ServerError(f"{self.name}: a batch object without an id: {str(body)[:200]}",
                              status=200)
        status = str(body.get("status"))
        found = body.get("request_counts")
        counts = found if isinstance(found, dict) else {}
        return BatchState(id=body["id"], status=status, ended=status in ENDED,
                          counts={k: int(v) for k, v in counts.items() if isinstance(v, int)})

    async def _batch(self, batch_id: str) -> dict[str, Any]:
        return (await call(self.session, "GET", f"/v1/batches/{batch_id}",
                           timeout=self.timeout)).json()

    async def state(self, batch_id: str) -> BatchState:
        return self._state(await self._batch(batch_id))

    async def cancel(self, batch_id: str) -> BatchState:
        return self._state((await call(self.session, "POST", f"/v1/batches/{batch_id}/cancel",
                                       timeout=self.timeout)).json())

    async def _file_lines(self, file_id: str | None) -> list[dict[str, Any]]:
        if not file_id:
            return []
        resp = await call(self.session, "GET", f"/v1/files/{file_id}/content",
                          timeout=self.timeout)
        lines = []
        for raw in resp.text.splitlines():
            try:
                line = json.loads(raw) if raw.strip() else None
            except ValueError:
                line = None
            if isinstance(line, dict) and isinstance(line.get("custom_id"), str):
                lines.append(line)
        return lines

    def _item(self, line: dict[str, Any]) -> ItemResult:
        cid = line["custom_id"]
        error, response = line.get("error"), line.get("response")
        if isinstance(error, dict):
            code = str(error.get("code"))
            return ItemResult(cid, error=ItemError(_LINE_ERRORS.get(code, "server_error"),
                                                   f"{self.name}: {code}: "
                                                   f"{str(error.get('message'))[:300]}"))
        status = response.get("status_code") if isinstance(response, dict) else None
        body = response.get("body") if isinstance(response, dict) else None
        if status != 200:
            detail = body.get("error") if isinstance(body, dict) else body
            kind = _status_kind(status) if isinstance(status, int) else "server_error"
            return ItemResult(cid, error=ItemError(kind, f"{self.name}: HTTP {status}: "
                                                         f"{str(detail)[:300]}"))
        try:
            return ItemResult(cid, response=parse_chat_completion(body, who=self.name))
        except ServerError as exc:
            return ItemResult(cid, error=ItemError("server_error", str(exc)))

    async def _results(self, batch_id: str) -> dict[str, ItemResult]:
        batch = await self._batch(batch_id)
        if batch.get("status") == "failed":  # validation: no request ran
            errors = (batch.get("errors") or {}).get("data") or []
            why = "; ".join(str(e.get("message")) for e in errors if isinstance(e, dict))
            raise ServerError(f"{self.name}: batch {batch_id} failed validation: "
                              f"{why[:500] or 'no reason given'}", status=200)
        out: dict[str, ItemResult] = {}
        for file_id in (batch.get("output_file_id"), batch.get("error_file_id")):
            for line in await self._file_lines(file_id):
                out.setdefault(line["custom_id"], self._item(line))
        return out
