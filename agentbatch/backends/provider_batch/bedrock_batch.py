"""Bedrock batch inference: records written to S3 as JSONL, ``CreateModelInvocationJob``
over them, polled with ``GetModelInvocationJob``, the ``.jsonl.out`` objects read back and
matched by ``recordId``; ``StopModelInvocationJob`` cancels.

Records are in the Converse format (``modelInvocationType="Converse"``), built by the sync
backend's own conversion (``bedrock_convert.converse_params``), so one request builder serves
every model and the replies parse as sync ones (``parse_converse``, usage included).

Configuration, from the environment (the URL is stored in the plan, options are not ours):
``AGENTBATCH_BEDROCK_BATCH_S3`` (``s3://bucket[/prefix]``, where inputs and outputs go) and
``AGENTBATCH_BEDROCK_BATCH_ROLE_ARN`` (the service role Bedrock reads and writes S3 with); the
per-model quotas ``AGENTBATCH_BEDROCK_BATCH_MIN_RECORDS`` / ``..._MAX_RECORDS`` (defaults 100
and 50,000) and ``AGENTBATCH_BEDROCK_BATCH_TIMEOUT_HOURS`` (24..168, default 24).

Each job gets its own folder, ``<prefix>/<name>/``: ``input.jsonl``, ``ids.json`` (recordId ->
custom_id) and ``output/``. Record ids are 11 alphanumerics (``R0000000000``: the strictest
form AWS has documented), so a ``custom_id`` never has to fit Bedrock's rules; ``ids.json``
maps them back, which keeps ``results`` stateless (any process may read any job).

boto3 blocks: every call runs in a worker thread (``asyncio.to_thread``) under a deadline.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import os
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from agentbatch.backends.bedrock import BedrockBackend, map_boto_error
from agentbatch.backends.bedrock_convert import parse_converse
from agentbatch.backends.provider_batch.client import DEFAULT_TIMEOUT_S, ProviderBatchClient
from agentbatch.backends.provider_batch.types import (
    BatchState,
    ItemError,
    ItemErrorKind,
    ItemResult,
)
from agentbatch.core.errors import BackendError, BackendTimeout, BatchSpecError, ServerError
from agentbatch.core.model_io import ModelRequest
from agentbatch.core.wait_for import wait_for

S3_ENV = "AGENTBATCH_BEDROCK_BATCH_S3"
ROLE_ENV = "AGENTBATCH_BEDROCK_BATCH_ROLE_ARN"
MIN_ENV = "AGENTBATCH_BEDROCK_BATCH_MIN_RECORDS"
MAX_ENV = "AGENTBATCH_BEDROCK_BATCH_MAX_RECORDS"
TIMEOUT_ENV = "AGENTBATCH_BEDROCK_BATCH_TIMEOUT_HOURS"

# Service-quota defaults ("Minimum number of records per batch inference job", "Records per
# batch inference job"): per model and adjustable per account, hence the variables above.
DEFAULT_MIN_RECORDS = 100
DEFAULT_MAX_RECORDS = 50_000
DEFAULT_TIMEOUT_HOURS = 24  # CreateModelInvocationJob's timeoutDurationInHours: 24..168
MIN_TIMEOUT_HOURS, MAX_TIMEOUT_HOURS = 24, 168

RUNNING = ("Submitted", "Validating", "Scheduled", "InProgress", "Stopping")
ENDED = ("Completed", "PartiallyCompleted", "Failed", "Stopped", "Expired")
# A job that ended early: what its unanswered records are.
_JOB_KINDS: dict[str, ItemErrorKind] = {"Expired": "expired", "Stopped": "cancelled",
                                        "Failed": "server_error"}
_ROLE_RE = re.compile(r"^arn:aws[a-z-]*:iam::\d{12}:role/.+$")
_S3_RE = re.compile(r"^s3://([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(/.*)?$")


@dataclass(frozen=True)
class BedrockBatchConfig:
    """Where a job's files go, the role Bedrock uses, and the per-job record quotas."""

    bucket: str
    prefix: str  # "" or "some/folder" (no leading or trailing slash)
    role_arn: str
    min_records: int = DEFAULT_MIN_RECORDS
    max_records: int = DEFAULT_MAX_RECORDS
    timeout_hours: int = DEFAULT_TIMEOUT_HOURS

    @classmethod
    def from_env(cls, who: str, env: dict[str, str] | None = None) -> BedrockBatchConfig:
        """The configuration from the environment, or ``BatchSpecError`` naming every variable
        that is missing or malformed (values of the role and bucket only, never credentials)."""
        env = dict(os.environ) if env is None else env
        location, role = env.get(S3_ENV, "").strip(), env.get(ROLE_ENV, "").strip()
        problems = []
        if not location:
            problems.append(f"{S3_ENV} (s3://bucket[/prefix] for the job's input and output) "
                            "is not set")
        elif not _S3_RE.match(location):
            problems.append(f"{S3_ENV}={location!r} is not s3://bucket[/prefix]")
        if not role:
            problems.append(f"{ROLE_ENV} (the service role Bedrock reads and writes that "
                            "S3 location with) is not set")
        elif not _ROLE_RE.match(role):
            problems.append(f"{ROLE_ENV}={role!r} is not an IAM role ARN "
                            "(arn:aws:iam::ACCOUNT:role/NAME)")
        min_records = _int_env(env, MIN_ENV, DEFAULT_MIN_RECORDS, 1, None, problems)
        max_records = _int_env(env, MAX_ENV, DEFAULT_MAX_RECORDS, 1, None, problems)
        hours = _int_env(env, TIMEOUT_ENV, DEFAULT_TIMEOUT_HOURS, MIN_TIMEOUT_HOURS,
                         MAX_TIMEOUT_HOURS, problems)
        if min_records > max_records:
            problems.append(f"{MIN_ENV}={min_records} is above {MAX_ENV}={max_records}")
        if problems:
            raise BatchSpecError(f"{who}: Bedrock batch inference is not configured: "
                                 + "; ".join(problems)
                                 + " (pricing='sync' needs none of this)")
        match = _S3_RE.match(location)
        assert match is not None
        return cls(bucket=match.group(1), prefix=(match.group(2) or "").strip("/"),
                   role_arn=role, min_records=min_records, max_records=max_records,
                   timeout_hours=hours)


def _int_env(env: dict[str, str], name: str, default: int, low: int, high: int | None,
             problems: list[str]) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        problems.append(f"{name}={raw!r} is not a whole number")
        return default
    if value < low or (high is not None and value > high):
        span = f"{low}..{high}" if high is not None else f">= {low}"
        problems.append(f"{name}={value} is outside {span}")
    return value


def record_id(n: int) -> str:
    """The ``n``-th record's id: 11 alphanumerics, as in AWS's own examples."""
    return f"R{n:010d}"


def _json_default(value: Any) -> Any:
    if isinstance(value, bytes | bytearray):  # an inline image: JSON carries it as base64
        return base64.b64encode(value).decode()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def model_input(params: dict[str, Any]) -> dict[str, Any]:
    """A Converse request body from ``converse`` keyword arguments: no ``modelId`` (the job
    names the model) and no ``cachePoint`` blocks (not documented for batch jobs; a field a
    job rejects would fail every record, a missing one costs only the cache discount)."""
    body = {k: v for k, v in params.items() if k != "modelId"}
    if isinstance(body.get("system"), list):
        body["system"] = [b for b in body["system"] if "cachePoint" not in b]
    return body


def _error_kind(code: Any) -> ItemErrorKind:
    try:
        status = int(code)
    except (TypeError, ValueError):
        return "server_error"
    if status == 429:
        return "rate_limited"
    if status == 408 or status >= 500:
        return "server_error"
    return "bad_request" if 400 <= status < 500 else "server_error"


class BedrockBatchClient(ProviderBatchClient):
    """Bedrock's batch inference for the model and region of ``backend``."""

    def __init__(self, backend: BedrockBackend, config: BedrockBatchConfig, *,
                 timeout: float = DEFAULT_TIMEOUT_S, bedrock: Any = None, s3: Any = None) -> None:
        self.backend = backend
        self.config = config
        self.name = f"{backend.name} batch"
        self.timeout = timeout
        # A job waits hours whatever its size, so one job takes every ready turn up to the
        # quota; fewer than the minimum are the caller's to send to the sync API.
        self.min_items = config.min_records
        self.max_items = self.quota_max_items = config.max_records
        self._bedrock, self._s3 = bedrock, s3

    # --- boto3 -----------------------------------------------------------------------------

    def _client(self, service: str) -> Any:
        boto3, config_cls = self.backend._boto3, self.backend._config_cls
        config = config_cls(read_timeout=self.timeout, connect_timeout=min(self.timeout, 10.0),
                            retries={"total_max_attempts": 3, "mode": "standard"},
                            user_agent_extra="agentbatch")
        return boto3.session.Session(region_name=self.backend.region).client(service,
                                                                            config=config)

    @property
    def bedrock(self) -> Any:
        """The ``bedrock`` control-plane client (jobs), created on first use."""
        if self._bedrock is None:
            self._bedrock = self._client("bedrock")
        return self._bedrock

    @property
    def s3(self) -> Any:
        if self._s3 is None:
            self._s3 = self._client("s3")
        return self._s3

    async def _call(self, fn: Callable[..., Any], **kwargs: Any) -> Any:
        """``fn(**kwargs)`` in a worker thread within ``timeout``; botocore failures as our
        ``BackendError`` (their messages are AWS's, never a credential)."""
        what = getattr(fn, "__name__", "call")
        try:
            return await wait_for(asyncio.to_thread(functools.partial(fn, **kwargs)),
                                          self.timeout)
        except asyncio.TimeoutError:
            raise BackendTimeout(f"{self.name}: no answer to {what} within "
                                 f"{self.timeout:g}s") from None
        except BackendError:
            raise
        except Exception as exc:
            raise map_boto_error(exc, f"{self.name}: {what}") from None

    # --- the protocol ----------------------------------------------------------------------

    async def discover(self) -> bool:
        """The account answers for batch jobs and the bucket is reachable. A refusal (no
        permission, no such bucket) is a ``BatchSpecError`` naming AWS's reason; an outage is
        the mapped, retryable ``BackendError``."""
        try:
            await self._call(self.bedrock.list_model_invocation_jobs, maxResults=1)
            await self._call(self.s3.head_bucket, Bucket=self.config.bucket)
        except BackendError as exc:
            if exc.retryable:
                raise
            raise BatchSpecError(f"pricing='batch': {exc} (Bedrock batch inference needs "
                                 "bedrock:ListModelInvocationJobs and the bucket of "
                                 f"{S3_ENV})") from None
        return True

    def _key(self, folder: str, name: str) -> str:
        return "/".join(p for p in (self.config.prefix, folder, name) if p)

    def _uri(self, key: str) -> str:
        return f"s3://{self.config.bucket}/{key}"

    def records(self, requests: Sequence[tuple[str, ModelRequest]]) -> tuple[str, bytes,
                                                                               dict[str, str]]:
        """``(model id, the JSONL body, recordId -> custom_id)`` for one job: one model per
        job (Bedrock names it once), refused otherwise."""
        models = {self.backend.model_id(req) for _, req in requests}
        if len(models) != 1 or not next(iter(models)):
            raise BatchSpecError(f"{self.name}: one Bedrock batch job runs one model; these "
                                 f"requests name {sorted(m or '(none)' for m in models)}")
        lines, ids = [], {}
        for n, (cid, req) in enumerate(requests):
            rid = record_id(n)
            ids[rid] = cid
            lines.append(json.dumps({"recordId": rid,
                                     "modelInput": model_input(self.backend.build_params(req))},
                                    ensure_ascii=False, allow_nan=False, default=_json_default))
        return models.pop(), ("\n".join(lines) + "\n").encode(), ids

    async def _submit(self, requests: Sequence[tuple[str, ModelRequest]]) -> BatchState:
        model, body, ids = self.records(requests)
        token = uuid.uuid4().hex
        name = f"agentbatch-{token[:20]}"
        input_key = self._key(name, "input.jsonl")
        await self._call(self.s3.put_object, Bucket=self.config.bucket,
                         Key=self._key(name, "ids.json"), Body=json.dumps(ids).encode(),
                         ContentType="application/json")
        await self._call(self.s3.put_object, Bucket=self.config.bucket, Key=input_key,
                         Body=body, ContentType="application/jsonl")
        created = await self._call(
            self.bedrock.create_model_invocation_job, jobName=name,
            roleArn=self.config.role_arn, clientRequestToken=token, modelId=model,
            modelInvocationType="Converse",
            inputDataConfig={"s3InputDataConfig": {"s3InputFormat": "JSONL",
                                                   "s3Uri": self._uri(input_key)}},
            outputDataConfig={"s3OutputDataConfig": {
                "s3Uri": self._uri(self._key(name, "output")) + "/"}},
            timeoutDurationInHours=self.config.timeout_hours)
        arn = created.get("jobArn") if isinstance(created, dict) else None
        if not isinstance(arn, str) or not arn:
            raise ServerError(f"{self.name}: CreateModelInvocationJob answered without a "
                              "jobArn", status=200)
        return BatchState(id=arn, status="Submitted", ended=False,
                          counts={"total": len(requests)})

    def _state(self, job: Any) -> BatchState:
        if not isinstance(job, dict) or not isinstance(job.get("jobArn"), str):
            raise ServerError(f"{self.name}: a batch job without a jobArn", status=200)
        status = str(job.get("status"))
        counts = {ours: int(job[theirs]) for ours, theirs in (
            ("total", "totalRecordCount"), ("processed", "processedRecordCount"),
            ("succeeded", "successRecordCount"), ("errored", "errorRecordCount"))
            if isinstance(job.get(theirs), int)}
        return BatchState(id=job["jobArn"], status=status, ended=status in ENDED,
                          counts=counts)

    async def _job(self, batch_id: str) -> dict[str, Any]:
        job = await self._call(self.bedrock.get_model_invocation_job, jobIdentifier=batch_id)
        return job if isinstance(job, dict) else {}

    async def state(self, batch_id: str) -> BatchState:
        return self._state(await self._job(batch_id))

    async def cancel(self, batch_id: str) -> BatchState:
        await self._call(self.bedrock.stop_model_invocation_job, jobIdentifier=batch_id)
        return await self.state(batch_id)

    async def _read(self, bucket: str, key: str) -> bytes:
        found = await self._call(self.s3.get_object, Bucket=bucket, Key=key)
        body = found["Body"]
        return await wait_for(asyncio.to_thread(body.read), self.timeout)

    async def _outputs(self, job: dict[str, Any]) -> list[tuple[str, str]]:
        """``(bucket, key)`` of the job's ``.jsonl.out`` objects (under its output folder,
        in a subfolder named by the job id)."""
        uri = str(((job.get("outputDataConfig") or {}).get("s3OutputDataConfig") or {})
                  .get("s3Uri") or "")
        match = _S3_RE.match(uri)
        if match is None:
            raise ServerError(f"{self.name}: job {job.get('jobArn')} has no S3 output location",
                              status=200)
        bucket, prefix = match.group(1), (match.group(2) or "").strip("/")
        job_id = str(job.get("jobArn", "")).rsplit("/", 1)[-1]
        folder = "/".join(p for p in (prefix, job_id) if p) + "/"
        keys: list[tuple[str, str]] = []
        kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": folder}
        while True:
            page = await self._call(self.s3.list_objects_v2, **kwargs)
            keys += [(bucket, o["Key"]) for o in page.get("Contents") or []
                     if str(o.get("Key", "")).endswith(".jsonl.out")]
            if not page.get("IsTruncated") or not page.get("NextContinuationToken"):
                return keys
            kwargs["ContinuationToken"] = page["NextContinuationToken"]

    async def _ids(self, job: dict[str, Any]) -> dict[str, str]:
        """recordId -> custom_id, from the ``ids.json`` next to the job's input."""
        uri = str(((job.get("inputDataConfig") or {}).get("s3InputDataConfig") or {})
                  .get("s3Uri") or "")
        match = _S3_RE.match(uri)
        if match is None:
            raise ServerError(f"{self.name}: job {job.get('jobArn')} has no S3 input location",
                              status=200)
        folder = (match.group(2) or "").strip("/").rsplit("/", 1)[0]
        found = json.loads(await self._read(match.group(1), f"{folder}/ids.json"))
        if not isinstance(found, dict):
            raise ServerError(f"{self.name}: {folder}/ids.json is not a JSON object", status=200)
        return {str(k): str(v) for k, v in found.items()}

    def _item(self, cid: str, line: dict[str, Any]) -> ItemResult:
        output, error = line.get("modelOutput"), line.get("error")
        if isinstance(output, dict):
            try:
                return ItemResult(cid, response=parse_converse(output, who=self.name))
            except ServerError as exc:
                return ItemResult(cid, error=ItemError("server_error", str(exc)))
        err = error if isinstance(error, dict) else {}
        code = err.get("errorCode")
        message = str(err.get("errorMessage") or error or "no modelOutput and no error")
        return ItemResult(cid, error=ItemError(_error_kind(code), f"{self.name}: error "
                                               f"{code}: {message[:300]}"))

    async def _collect(self, batch_id: str) -> tuple[dict[str, Any], dict[str, ItemResult]]:
        job = await self._job(batch_id)
        ids = await self._ids(job)
        out: dict[str, ItemResult] = {}
        for bucket, key in await self._outputs(job):
            for raw in (await self._read(bucket, key)).decode("utf-8", "replace").splitlines():
                try:
                    line = json.loads(raw) if raw.strip() else None
                except ValueError:
                    continue
                if not isinstance(line, dict):
                    continue
                cid = ids.get(str(line.get("recordId")))
                if cid is not None:
                    out.setdefault(cid, self._item(cid, line))
        kind = _JOB_KINDS.get(str(job.get("status")))
        if kind is not None:  # the job ended early: every record it did not answer says why
            why = str(job.get("message") or "no reason given")[:300]
            for cid in ids.values():
                out.setdefault(cid, ItemResult(cid, error=ItemError(
                    kind, f"{self.name}: job {batch_id} {job.get('status')} before this "
                          f"record ran: {why}")))
        return job, out

    async def _results(self, batch_id: str) -> dict[str, ItemResult]:
        return (await self._collect(batch_id))[1]

    async def aclose(self) -> None:
        for client in (self._bedrock, self._s3):
            if client is not None and hasattr(client, "close"):
                await asyncio.to_thread(client.close)
        self._bedrock = self._s3 = None


def bedrock_batch_client(backend: BedrockBackend, *, env: dict[str, str] | None = None,
                         bedrock: Any = None, s3: Any = None) -> BedrockBatchClient:
    """The batch client for ``backend``; ``BatchSpecError`` naming what is not configured."""
    config = BedrockBatchConfig.from_env(f"pricing='batch' on {backend.name}", env)
    return BedrockBatchClient(backend, config, bedrock=bedrock, s3=s3)
