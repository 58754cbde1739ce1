"""Provider batch APIs over HTTP: OpenAI's files + batches, Anthropic's message batches.

OpenAI: ``POST /v1/files`` (multipart, ``purpose=batch``, JSONL of ``{custom_id, method,
url, body}``), ``POST /v1/batches``, ``GET /v1/batches/{id}``, ``POST
/v1/batches/{id}/cancel``, ``GET /v1/files/{id}/content`` (the output and error files).
Anthropic: ``POST /v1/messages/batches``, ``GET .../{id}``, ``POST .../{id}/cancel``, ``GET
.../{id}/results`` (the ``results_url``). Timing and outcomes are ``batch_jobs``'s.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections import Counter
from typing import Any

from aiohttp import web

from agentbatch.sim.batch_jobs import Item, Job, make_job
from agentbatch.sim.config import SimConfig
from agentbatch.sim.openai_shapes import chat_completion, error_body, usage
from agentbatch.sim.script import content_text

CHAT_URL = "/v1/chat/completions"


class BatchApiState:
    """Jobs and files of one simulator instance, owned by its event loop."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.jobs: dict[str, Job] = {}
        self.files: dict[str, tuple[dict[str, Any], bytes]] = {}  # id -> (object, content)
        self._billed_before: dict[str, Counter[str]] = {}  # the ledger at the last reset

    def add_file(self, name: str, purpose: str, content: bytes) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "id": f"file-{uuid.uuid4().hex[:24]}", "object": "file", "bytes": len(content),
            "created_at": int(time.time()), "filename": name, "purpose": purpose}
        self.files[obj["id"]] = (obj, content)
        return obj

    def _ledger(self) -> dict[str, Counter[str]]:
        now = time.monotonic()
        ledger: dict[str, Counter[str]] = {}
        for job in self.jobs.values():
            for item in job.items:
                if job.outcome(item, now) == "succeeded":
                    row = ledger.setdefault(str(item.body.get("model")), Counter())
                    row.update(requests=1, prompt_tokens=item.prompt_tokens,
                               completion_tokens=item.completion_tokens)
        return ledger

    def billed(self) -> dict[str, dict[str, int]]:
        """The provider's bill for its batch APIs since start or the last ``/sim/reset``,
        per model: ``requests``, ``prompt_tokens`` and ``completion_tokens`` of every
        request that succeeded, i.e. finished before its job was cancelled or expired,
        whether or not anyone read its result (as OpenAI and Anthropic bill). Errored,
        expired and canceled requests are free. Lets a test or a benchmark compare a
        client's accounting with what it was charged."""
        out = {}
        for model, row in self._ledger().items():
            row.subtract(self._billed_before.get(model, Counter()))
            if row["requests"]:
                out[model] = {k: int(row[k])
                              for k in ("requests", "prompt_tokens", "completion_tokens")}
        return out

    def timeline(self) -> list[dict[str, Any]]:
        """Every job's timeline as decided at its creation (``time.monotonic()`` seconds, the
        host's clock): ``created``, ``cancelled``, ``end`` (when its last request finishes
        on its own, cancelled or not; None if one is held) and per request ``custom_id``,
        ``ready`` (when it finishes; None: held), ``fail`` and its tokens. The ground truth a
        benchmark reads: a client that cancelled a batch or won a hedge never sees when the
        batch would have answered (``/sim/batch_jobs``)."""
        out = []
        for job in self.jobs.values():
            ready = [None if math.isinf(i.ready_at) else i.ready_at for i in job.items]
            last = max((i.ready_at for i in job.items), default=job.created)
            out.append({
                "id": job.id, "kind": job.kind, "created": job.created,
                "cancelled": job.cancelled, "expires": job.expires,
                "end": None if math.isinf(last) else last,
                "items": [{"custom_id": i.custom_id, "ready": r, "fail": i.fail,
                           "prompt_tokens": i.prompt_tokens,
                           "completion_tokens": i.completion_tokens}
                          for i, r in zip(job.items, ready, strict=True)]})
        return out

    def reset_billed(self) -> None:
        """``billed`` counts from now (``/sim/reset``; the jobs themselves stay)."""
        self._billed_before = self._ledger()


BATCH_API = web.AppKey("agentbatch_sim_batch_api", BatchApiState)


def _err(status: int, message: str, type_: str = "invalid_request_error") -> web.Response:
    return web.json_response(error_body(message, type_, status), status=status)


def _job(request: web.Request, kind: str) -> Job | web.Response:
    job = request.app[BATCH_API].jobs.get(request.match_info["id"])
    if job is None or job.kind != kind:
        return _err(404, f"No batch found with id '{request.match_info['id']}'.", "not_found")
    return job


def _jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines).encode()


# --- OpenAI -------------------------------------------------------------------------------


async def upload_file(request: web.Request) -> web.Response:
    form = await request.post()
    upload, purpose = form.get("file"), form.get("purpose")
    if purpose != "batch" or not isinstance(upload, web.FileField):
        return _err(400, "send multipart form fields 'purpose'='batch' and 'file'")
    obj = request.app[BATCH_API].add_file(upload.filename, "batch", upload.file.read())
    return web.json_response(obj)


async def file_content(request: web.Request) -> web.Response:
    found = request.app[BATCH_API].files.get(request.match_info["id"])
    if found is None:
        return _err(404, f"No such File object: {request.match_info['id']}", "not_found")
    return web.Response(body=found[1], content_type="application/jsonl")


def _parse_lines(content: bytes) -> tuple[list[tuple[str, dict[str, Any]]],
                                               list[dict[str, Any]]]:
    """(custom_id, body) per JSONL line, and the validation errors OpenAI would report."""
    requests: list[tuple[str, dict[str, Any]]] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    for n, raw in enumerate(content.decode("utf-8", "replace").splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            line = json.loads(raw)
        except ValueError:
            line = None
        cid = line.get("custom_id") if isinstance(line, dict) else None
        body = line.get("body") if isinstance(line, dict) else None
        problem = None
        if not isinstance(cid, str) or not cid:
            problem = "each line needs a non-empty string custom_id"
        elif cid in seen:
            problem = f"custom_id {cid!r} is repeated"
        elif line.get("method") != "POST" or line.get("url") != CHAT_URL:
            problem = f"method must be POST and url {CHAT_URL}"
        elif not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            problem = "body must be a chat completion request with messages"
        if problem is None and isinstance(cid, str) and isinstance(body, dict):
            seen.add(cid)
            requests.append((cid, body))
        else:
            errors.append({"code": "invalid_request", "message": problem, "line": n})
    if not requests and not errors:
        errors.append({"code": "empty_file", "message": "the input file has no requests",
                       "line": None})
    return requests, errors


async def create_batch(request: web.Request) -> web.Response:
    api = request.app[BATCH_API]
    try:
        body = await request.json()
    except ValueError:
        body = None
    if not isinstance(body, dict) or body.get("endpoint") != CHAT_URL:
        return _err(400, f"send JSON with input_file_id, endpoint={CHAT_URL!r}, "
                         "completion_window")
    found = api.files.get(str(body.get("input_file_id")))
    if found is None:
        return _err(400, f"input_file_id {body.get('input_file_id')!r} was not uploaded")
    requests, errors = _parse_lines(found[1])
    job = make_job(api.config, "openai", [] if errors else requests, "batch_")
    job.meta = {"input_file_id": found[0]["id"], "metadata": body.get("metadata"),
                "completion_window": body.get("completion_window", "24h"), "errors": errors}
    api.jobs[job.id] = job
    return web.json_response(_openai_batch(api, job))


def _openai_line(job: Job, item: Item, outcome: str) -> dict[str, Any]:
    rid = f"batch_req_{uuid.uuid4().hex[:24]}"
    if outcome == "succeeded":
        reply = chat_completion(f"chatcmpl-{uuid.uuid4().hex}", str(item.body.get("model")),
                                int(time.time()), item.reply,
                                usage(item.prompt_tokens, 0, item.completion_tokens))
        return {"id": rid, "custom_id": item.custom_id, "error": None,
                "response": {"status_code": 200, "request_id": rid, "body": reply}}
    if outcome == "errored":
        return {"id": rid, "custom_id": item.custom_id, "error": None, "response": {
            "status_code": 500, "request_id": rid,
            "body": error_body("simulated batch request failure", "server_error", 500)}}
    code = "batch_expired" if outcome == "expired" else "batch_cancelled"
    return {"id": rid, "custom_id": item.custom_id, "response": None,
            "error": {"code": code, "message": f"the batch was {outcome} before this request "
                                               "ran"}}


def _openai_status(job: Job, now: float) -> str:
    if job.meta.get("errors"):
        return "failed"
    if job.ended_at(now) is None:
        return "cancelling" if job.cancelled is not None else "in_progress"
    if job.cancelled is not None and job.cancelled <= job.expires:
        return "cancelled"
    counts = job.counts(now)
    return "expired" if counts["expired"] else "completed"


def _openai_batch(api: BatchApiState, job: Job) -> dict[str, Any]:
    now = time.monotonic()
    status = _openai_status(job, now)
    ended = job.ended_at(now)
    if ended is not None and not job.files and job.items:
        good: list[dict[str, Any]] = []
        bad: list[dict[str, Any]] = []
        for item in job.items:
            outcome = job.outcome(item, now)
            (good if outcome == "succeeded" else bad).append(_openai_line(job, item, outcome))
        for name, lines in (("output", good), ("error", bad)):
            if lines:
                job.files[name] = api.add_file(f"{job.id}_{name}.jsonl", f"batch_{name}",
                                               _jsonl(lines))["id"]
    counts = job.counts(now)
    done_at = job.wall(ended) if ended is not None else None
    errors = job.meta.get("errors")
    return {
        "id": job.id, "object": "batch", "endpoint": CHAT_URL,
        "errors": {"object": "list", "data": errors} if errors else None,
        "input_file_id": job.meta.get("input_file_id"),
        "completion_window": job.meta.get("completion_window"), "status": status,
        "output_file_id": job.files.get("output"), "error_file_id": job.files.get("error"),
        "created_at": job.wall(job.created), "in_progress_at": job.wall(job.created),
        "expires_at": job.wall(job.expires),
        "completed_at": done_at if status == "completed" else None,
        "failed_at": job.wall(job.created) if status == "failed" else None,
        "expired_at": done_at if status == "expired" else None,
        "cancelling_at": job.wall(job.cancelled) if job.cancelled is not None else None,
        "cancelled_at": done_at if status == "cancelled" else None,
        "request_counts": {"total": len(job.items), "completed": counts["succeeded"],
                           "failed": len(job.items) - counts["succeeded"] - counts["processing"]},
        "metadata": job.meta.get("metadata"),
    }


async def list_batches(request: web.Request) -> web.Response:
    api = request.app[BATCH_API]
    data = [_openai_batch(api, j) for j in api.jobs.values() if j.kind == "openai"]
    return web.json_response({"object": "list", "data": data, "has_more": False})


async def get_batch(request: web.Request) -> web.Response:
    job = _job(request, "openai")
    if isinstance(job, web.Response):
        return job
    return web.json_response(_openai_batch(request.app[BATCH_API], job))


async def cancel_batch(request: web.Request) -> web.Response:
    job = _job(request, "openai")
    if isinstance(job, web.Response):
        return job
    if job.cancelled is None and job.ended_at(time.monotonic()) is None:
        job.cancelled = time.monotonic()
    return web.json_response(_openai_batch(request.app[BATCH_API], job))


# --- Anthropic ----------------------------------------------------------------------------


def _blocks(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return [b for b in content if isinstance(b, dict)] if isinstance(content, list) else []


def chat_body(params: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic Messages request as the OpenAI chat body the scripted model reads."""
    messages: list[dict[str, Any]] = []
    system = params.get("system")
    if system:
        messages.append({"role": "system", "content": content_text(system)})
    for message in params.get("messages") or []:
        blocks = _blocks(message.get("content") if isinstance(message, dict) else None)
        text = "".join(b.get("text", "") for b in blocks if b.get("type") == "text")
        if message.get("role") == "assistant":
            calls = [{"id": b.get("id"), "type": "function", "function": {
                "name": b.get("name"), "arguments": json.dumps(b.get("input") or {})}}
                for b in blocks if b.get("type") == "tool_use"]
            out: dict[str, Any] = {"role": "assistant", "content": text or None}
            if calls:
                out["tool_calls"] = calls
            messages.append(out)
            continue
        messages += [{"role": "tool", "tool_call_id": b.get("tool_use_id"),
                      "content": content_text(b.get("content"))}
                     for b in blocks if b.get("type") == "tool_result"]
        if text:
            messages.append({"role": "user", "content": text})
    body: dict[str, Any] = {"model": params.get("model"), "messages": messages,
                            "max_tokens": params.get("max_tokens")}
    tools = [{"type": "function", "function": {"name": t.get("name"),
              "description": t.get("description", ""), "parameters": t.get("input_schema")}}
             for t in params.get("tools") or [] if isinstance(t, dict)]
    if tools:
        body["tools"] = tools
        choice = (params.get("tool_choice") or {}).get("type")
        modes: dict[object, str] = {"any": "required", "none": "none"}
        body["tool_choice"] = modes.get(choice, "auto")
    return body


def _message(item: Item) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if item.reply.content:
        content.append({"type": "text", "text": item.reply.content})
    for call in item.reply.tool_calls:
        try:
            args = json.loads(call.arguments)
        except ValueError:
            args = {}
        content.append({"type": "tool_use", "id": call.id, "name": call.name, "input": args})
    stop = {"tool_calls": "tool_use", "length": "max_tokens"}.get(item.reply.finish_reason,
                                                                   "end_turn")
    return {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
            "model": item.body.get("model"), "content": content, "stop_reason": stop,
            "stop_sequence": None,
            "usage": {"input_tokens": item.prompt_tokens, "output_tokens": item.completion_tokens,
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}}


def _anthropic_batch(request: web.Request, job: Job) -> dict[str, Any]:
    now = time.monotonic()
    ended = job.ended_at(now)
    counts = job.counts(now)
    status = "ended" if ended is not None else (
        "canceling" if job.cancelled is not None else "in_progress")
    results = f"{request.url.origin()}/v1/messages/batches/{job.id}/results"
    return {
        "id": job.id, "type": "message_batch", "processing_status": status,
        "request_counts": {"processing": counts["processing"],
                           "succeeded": counts["succeeded"], "errored": counts["errored"],
                           "canceled": counts["canceled"], "expired": counts["expired"]},
        "ended_at": _iso(job.wall(ended)) if ended is not None else None,
        "created_at": _iso(job.wall(job.created)), "expires_at": _iso(job.wall(job.expires)),
        "cancel_initiated_at": _iso(job.wall(job.cancelled)) if job.cancelled else None,
        "results_url": results if ended is not None else None,
    }


def _iso(unix: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(unix))


async def create_message_batch(request: web.Request) -> web.Response:
    api = request.app[BATCH_API]
    try:
        body = await request.json()
    except ValueError:
        body = None
    reqs = body.get("requests") if isinstance(body, dict) else None
    if not isinstance(reqs, list) or not reqs:
        return _err(400, "requests: a non-empty list of {custom_id, params}")
    pairs: list[tuple[str, dict[str, Any]]] = []
    for n, r in enumerate(reqs):
        cid = r.get("custom_id") if isinstance(r, dict) else None
        params = r.get("params") if isinstance(r, dict) else None
        if not isinstance(cid, str) or not cid or not isinstance(params, dict):
            return _err(400, f"requests.{n}: needs a custom_id string and a params object")
        if any(cid == seen for seen, _ in pairs):
            return _err(400, f"requests.{n}: custom_id {cid!r} is repeated")
        pairs.append((cid, chat_body(params)))
    job = make_job(api.config, "anthropic", pairs, "msgbatch_")
    job.meta = {"requests": reqs}  # as sent (cache_control included), for tests to read
    api.jobs[job.id] = job
    return web.json_response(_anthropic_batch(request, job))


async def list_message_batches(request: web.Request) -> web.Response:
    jobs = request.app[BATCH_API].jobs.values()
    data = [_anthropic_batch(request, j) for j in jobs if j.kind == "anthropic"]
    return web.json_response({"data": data, "has_more": False})


async def get_message_batch(request: web.Request) -> web.Response:
    job = _job(request, "anthropic")
    if isinstance(job, web.Response):
        return job
    return web.json_response(_anthropic_batch(request, job))


async def cancel_message_batch(request: web.Request) -> web.Response:
    job = _job(request, "anthropic")
    if isinstance(job, web.Response):
        return job
    if job.cancelled is None and job.ended_at(time.monotonic()) is None:
        job.cancelled = time.monotonic()
    return web.json_response(_anthropic_batch(request, job))


async def message_batch_results(request: web.Request) -> web.Response:
    job = _job(request, "anthropic")
    if isinstance(job, web.Response):
        return job
    now = time.monotonic()
    if job.ended_at(now) is None:
        return _err(400, f"batch {job.id} is still processing; results come once it has ended")
    lines = []
    for item in job.items:
        outcome = job.outcome(item, now)
        result: dict[str, Any] = {"type": outcome}
        if outcome == "succeeded":
            result["message"] = _message(item)
        elif outcome == "errored":
            result["error"] = {"type": "error", "error": {
                "type": "api_error", "message": "simulated batch request failure"}}
        lines.append({"custom_id": item.custom_id, "result": result})
    return web.Response(body=_jsonl(lines), content_type="application/x-jsonl")


def install(app: web.Application, config: SimConfig) -> None:
    """Serve both batch APIs from ``app``."""
    app[BATCH_API] = BatchApiState(config)
    add = app.router
    add.add_post("/v1/files", upload_file)
    add.add_get("/v1/files/{id}/content", file_content)
    add.add_post("/v1/batches", create_batch)
    add.add_get("/v1/batches", list_batches)
    add.add_get("/v1/batches/{id}", get_batch)
    add.add_post("/v1/batches/{id}/cancel", cancel_batch)
    add.add_post("/v1/messages/batches", create_message_batch)
    add.add_get("/v1/messages/batches", list_message_batches)
    add.add_get("/v1/messages/batches/{id}", get_message_batch)
    add.add_post("/v1/messages/batches/{id}/cancel", cancel_message_batch)
    add.add_get("/v1/messages/batches/{id}/results", message_batch_results)
