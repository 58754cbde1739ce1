"""BedrockBatchClient against real botocore ``bedrock`` and ``s3`` clients with ``Stubber``:
the exact S3 objects and job request, the state mapping, results matched by ``recordId``, a
job that ends early, cancel, and the refusals. No network: the stubber answers first."""

from __future__ import annotations

import base64
import io
import json
import socket
import uuid
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from botocore.response import StreamingBody
from botocore.stub import Stubber

from agentbatch import run_batch
from agentbatch.backends.bedrock import BedrockBackend
from agentbatch.backends.provider_batch import (
    AnthropicBatchClient,
    OpenAIBatchClient,
    batch_client,
)
from agentbatch.backends.provider_batch import bedrock_batch as bb
from agentbatch.backends.provider_batch.bedrock_batch import (
    BedrockBatchClient,
    bedrock_batch_client,
)
from agentbatch.backends.provider_batch.client import DEFAULT_MAX_ITEMS
from agentbatch.core.errors import BatchSpecError, RateLimited, ServerError
from agentbatch.core.model_io import ModelRequest

MODEL = "us.anthropic.claude-3-7-sonnet-20250219-v1:0"  # caches: its cachePoint is dropped
ROLE = "arn:aws:iam::123456789012:role/BedrockBatch"
SECRET = "fake-secret-never-shown"
ENV = {bb.S3_ENV: "s3://agentbatch-test/jobs", bb.ROLE_ENV: ROLE, bb.MIN_ENV: "2"}
JOB = "arn:aws:bedrock:us-east-1:123456789012:model-invocation-job/abc123xyz"
TOKEN = "0123456789abcdef0123456789abcdef"
NAME = f"agentbatch-{TOKEN[:20]}"
FOLDER = f"jobs/{NAME}"


@pytest.fixture(autouse=True)
def fake_aws(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAFAKEFAKEFAKE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    for name in (bb.S3_ENV, bb.ROLE_ENV, bb.MIN_ENV, bb.MAX_ENV, bb.TIMEOUT_ENV):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def backend() -> BedrockBackend:
    return BedrockBackend(f"bedrock://us-east-1/{MODEL}", timeout=30)


@pytest.fixture(scope="module")
def aws_clients() -> tuple[Any, Any]:
    """Built once (a botocore client costs seconds of CPU on a loaded machine); each test
    stubs them afresh. Fake keys: nothing is signed for real, nothing is sent."""
    session = boto3.session.Session(region_name="us-east-1", aws_access_key_id="AKIAFAKEFAKE",
                                    aws_secret_access_key=SECRET)
    return session.client("bedrock"), session.client("s3")


@pytest.fixture
def stubs(aws_clients: tuple[Any, Any]) -> Iterator[tuple[Stubber, Stubber, Any, Any]]:
    bedrock, s3 = aws_clients
    with Stubber(bedrock) as bstub, Stubber(s3) as sstub:
        yield bstub, sstub, bedrock, s3
        bstub.assert_no_pending_responses()
        sstub.assert_no_pending_responses()


@pytest.fixture
def client(backend: BedrockBackend,
           stubs: tuple[Stubber, Stubber, Any, Any]) -> BedrockBatchClient:
    return bedrock_batch_client(backend, env=ENV, bedrock=stubs[2], s3=stubs[3])


def request(text: str, system: str | None = None) -> ModelRequest:
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": text}]
    return ModelRequest(model="ignored-the-url-names-it", messages=messages, max_tokens=64)


def body(data: bytes) -> StreamingBody:
    return StreamingBody(io.BytesIO(data), len(data))


def job(status: str, **extra: Any) -> dict[str, Any]:
    return {"jobArn": JOB, "jobName": NAME, "modelId": MODEL, "roleArn": ROLE,
            "status": status, "submitTime": "2026-11-26T00:00:00Z",
            "inputDataConfig": {"s3InputDataConfig": {
                "s3Uri": f"s3://agentbatch-test/{FOLDER}/input.jsonl"}},
            "outputDataConfig": {"s3OutputDataConfig": {
                "s3Uri": f"s3://agentbatch-test/{FOLDER}/output/"}}, **extra}


def converse_output(text: str, inp: int, out: int, cached: int = 0) -> dict[str, Any]:
    return {"output": {"message": {"role": "assistant", "content": [{"text": text}]}},
            "stopReason": "end_turn",
            "usage": {"inputTokens": inp, "outputTokens": out, "totalTokens": inp + out,
                      "cacheReadInputTokens": cached}}


def expect_results(bstub: Stubber, sstub: Stubber, status: str, ids: dict[str, str],
                   lines: list[dict[str, Any]], **extra: Any) -> None:
    """The calls ``results`` makes: the job, its ids.json, the listing, each output."""
    bstub.add_response("get_model_invocation_job", job(status, **extra), {"jobIdentifier": JOB})
    sstub.add_response("get_object", {"Body": body(json.dumps(ids).encode())},
                       {"Bucket": "agentbatch-test", "Key": f"{FOLDER}/ids.json"})
    out_key = f"{FOLDER}/output/abc123xyz/input.jsonl.out"
    sstub.add_response("list_objects_v2", {"Contents": [
        {"Key": f"{FOLDER}/output/abc123xyz/manifest.json.out"}, {"Key": out_key}],
        "IsTruncated": False},
        {"Bucket": "agentbatch-test", "Prefix": f"{FOLDER}/output/abc123xyz/"})
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    sstub.add_response("get_object", {"Body": body(data)},
                       {"Bucket": "agentbatch-test", "Key": out_key})


async def test_submit_writes_the_records_and_creates_a_converse_job(
        client: BedrockBatchClient, stubs: tuple[Stubber, Stubber, Any, Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    bstub, sstub, _, _ = stubs
    monkeypatch.setattr(bb.uuid, "uuid4", lambda: uuid.UUID(TOKEN))
    ids = {"R0000000000": "t1-a", "R0000000001": "t2-b"}
    records = [
        {"recordId": "R0000000000", "modelInput": {
            "messages": [{"role": "user", "content": [{"text": "Hi"}]}],
            "system": [{"text": "Be brief."}],  # the cachePoint sync adds is left out
            "inferenceConfig": {"maxTokens": 64}}},
        {"recordId": "R0000000001", "modelInput": {
            "messages": [{"role": "user", "content": [{"text": "Bye"}]}],
            "inferenceConfig": {"maxTokens": 64}}},
    ]
    jsonl = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()
    sstub.add_response("put_object", {}, {
        "Bucket": "agentbatch-test", "Key": f"{FOLDER}/ids.json",
        "Body": json.dumps(ids).encode(), "ContentType": "application/json"})
    sstub.add_response("put_object", {}, {
        "Bucket": "agentbatch-test", "Key": f"{FOLDER}/input.jsonl", "Body": jsonl,
        "ContentType": "application/jsonl"})
    bstub.add_response("create_model_invocation_job", {"jobArn": JOB}, {
        "jobName": NAME, "roleArn": ROLE, "clientRequestToken": TOKEN, "modelId": MODEL,
        "modelInvocationType": "Converse",
        "inputDataConfig": {"s3InputDataConfig": {
            "s3InputFormat": "JSONL", "s3Uri": f"s3://agentbatch-test/{FOLDER}/input.jsonl"}},
        "outputDataConfig": {"s3OutputDataConfig": {
            "s3Uri": f"s3://agentbatch-test/{FOLDER}/output/"}},
        "timeoutDurationInHours": 24})
    state = await client.submit([("t1-a", request("Hi", system="Be brief.")),
                                 ("t2-b", request("Bye"))])
    assert (state.id, state.ended, state.counts) == (JOB, False, {"total": 2})


@pytest.mark.parametrize(("status", "ended"), [
    ("Submitted", False), ("Validating", False), ("Scheduled", False), ("InProgress", False),
    ("Stopping", False), ("Completed", True), ("PartiallyCompleted", True), ("Failed", True),
    ("Stopped", True), ("Expired", True)])
async def test_state_maps_every_job_status(client: BedrockBatchClient,
                                           stubs: tuple[Stubber, Stubber, Any, Any],
                                           status: str, ended: bool) -> None:
    stubs[0].add_response("get_model_invocation_job", job(
        status, totalRecordCount=3, processedRecordCount=2, successRecordCount=1,
        errorRecordCount=1), {"jobIdentifier": JOB})
    state = await client.state(JOB)
    assert (state.id, state.status, state.ended) == (JOB, status, ended)
    assert state.counts == {"total": 3, "processed": 2, "succeeded": 1, "errored": 1}


async def test_results_match_by_record_id_with_usage_and_one_errored_record(
        client: BedrockBatchClient, stubs: tuple[Stubber, Stubber, Any, Any]) -> None:
    bstub, sstub, _, _ = stubs
    ids = {"R0000000000": "c-a", "R0000000001": "c-b", "R0000000002": "c-c",
           "R0000000003": "c-d"}
    lines = [  # not in input order: matched by recordId, never by position
        {"recordId": "R0000000002", "modelInput": {},
         "error": {"errorCode": 400, "errorMessage": "Malformed input request"}},
        {"recordId": "R0000000000", "modelInput": {},
         "modelOutput": converse_output("A", inp=10, out=3, cached=90)},
        {"recordId": "R0000000001", "modelInput": {},
         "modelOutput": converse_output("B", inp=20, out=4)},
        {"recordId": "R0000000003", "modelInput": {},
         "error": {"errorCode": 429, "errorMessage": "Too many requests"}},
        {"recordId": "R9999999999", "modelInput": {}, "modelOutput": converse_output("?", 1, 1)},
    ]
    expect_results(bstub, sstub, "PartiallyCompleted", ids, lines)
    found = await client.results(JOB, ["c-a", "c-b", "c-c", "c-d"])
    a, b, c, d = (found[k] for k in ("c-a", "c-b", "c-c", "c-d"))
    assert a.response is not None and a.response.text == "A"
    assert (a.response.usage.prompt_tokens, a.response.usage.cached_tokens,
            a.response.usage.completion_tokens) == (100, 90, 3)
    assert b.response is not None and b.response.text == "B"
    assert b.response.usage.prompt_tokens == 20 and b.response.usage.completion_tokens == 4
    assert c.error is not None and c.error.kind == "bad_request" and not c.error.retryable
    assert "Malformed input request" in c.error.message
    assert d.error is not None and d.error.kind == "rate_limited" and d.error.retryable
    assert set(found) == {"c-a", "c-b", "c-c", "c-d"}


async def test_a_record_the_completed_job_left_out_is_missing(
        client: BedrockBatchClient, stubs: tuple[Stubber, Stubber, Any, Any]) -> None:
    bstub, sstub, _, _ = stubs
    expect_results(bstub, sstub, "Completed", {"R0000000000": "c-a", "R0000000001": "c-b"},
                   [{"recordId": "R0000000000", "modelOutput": converse_output("A", 1, 1)}])
    found = await client.results(JOB, ["c-a", "c-b"])
    assert found["c-a"].ok
    assert found["c-b"].error is not None and found["c-b"].error.kind == "missing"


@pytest.mark.parametrize(("status", "kind"), [
    ("Failed", "server_error"), ("Expired", "expired"), ("Stopped", "cancelled")])
async def test_a_job_that_ended_early_errors_every_unanswered_record(
        client: BedrockBatchClient, stubs: tuple[Stubber, Stubber, Any, Any],
        status: str, kind: str) -> None:
    bstub, sstub, _, _ = stubs
    ids = {"R0000000000": "c-a", "R0000000001": "c-b", "R0000000002": "c-c"}
    expect_results(bstub, sstub, status, ids,
                   [{"recordId": "R0000000001", "modelOutput": converse_output("B", 5, 2)}],
                   message="the job ran out of time")
    found = await client.results(JOB, ["c-a", "c-b", "c-c"])
    assert found["c-b"].ok  # answered before the job ended: kept
    for cid in ("c-a", "c-c"):
        error = found[cid].error
        assert error is not None and error.kind == kind and error.retryable
        assert status in error.message and "the job ran out of time" in error.message


async def test_cancel_stops_the_job(client: BedrockBatchClient,
                                    stubs: tuple[Stubber, Stubber, Any, Any]) -> None:
    bstub = stubs[0]
    bstub.add_response("stop_model_invocation_job", {}, {"jobIdentifier": JOB})
    bstub.add_response("get_model_invocation_job", job("Stopping"), {"jobIdentifier": JOB})
    state = await client.cancel(JOB)
    assert (state.status, state.ended) == ("Stopping", False)


async def test_a_batch_below_the_minimum_is_refused_before_any_upload(
        client: BedrockBatchClient) -> None:
    # no stubbed responses: any S3 or Bedrock call would fail the test with "Unexpected call"
    with pytest.raises(BatchSpecError, match=r"at least 2 requests per batch.*got 1"):
        await client.submit([("only", request("Hi"))])


async def test_requests_for_two_models_are_refused(stubs: tuple[Stubber, Stubber, Any, Any]
                                                   ) -> None:
    plain = BedrockBackend("bedrock://us-east-1", timeout=30)  # the request names the model
    client = bedrock_batch_client(plain, env=ENV, bedrock=stubs[2], s3=stubs[3])
    one, two = request("a"), request("b")
    one.model, two.model = "amazon.nova-lite-v1:0", "amazon.nova-pro-v1:0"
    with pytest.raises(BatchSpecError, match="one model"):
        await client.submit([("a", one), ("b", two)])


def test_quotas_default_from_the_service_quota() -> None:
    config = bb.BedrockBatchConfig.from_env("x", {bb.S3_ENV: "s3://b-1", bb.ROLE_ENV: ROLE})
    assert (config.bucket, config.prefix) == ("b-1", "")
    assert (config.min_records, config.max_records, config.timeout_hours) == (100, 50_000, 24)


async def test_missing_configuration_is_refused_naming_what_is_missing(
        backend: BedrockBackend) -> None:
    with pytest.raises(BatchSpecError) as caught:
        await batch_client(backend)  # the warm-up hook both engines call for pricing="batch"
    message = str(caught.value)
    assert bb.S3_ENV in message and bb.ROLE_ENV in message and "not set" in message
    assert SECRET not in message


def test_malformed_configuration_is_refused_naming_each_variable() -> None:
    with pytest.raises(BatchSpecError) as caught:
        bb.BedrockBatchConfig.from_env("x", {bb.S3_ENV: "bucket-without-scheme",
                                             bb.ROLE_ENV: "BedrockBatch",
                                             bb.TIMEOUT_ENV: "200"})
    message = str(caught.value)
    assert f"{bb.S3_ENV}='bucket-without-scheme'" in message
    assert f"{bb.ROLE_ENV}='BedrockBatch'" in message and f"{bb.TIMEOUT_ENV}=200" in message


async def test_discover_turns_a_refusal_into_a_clear_error(
        client: BedrockBatchClient, stubs: tuple[Stubber, Stubber, Any, Any]) -> None:
    bstub, sstub, _, _ = stubs
    bstub.add_response("list_model_invocation_jobs", {"invocationJobSummaries": []},
                       {"maxResults": 1})
    sstub.add_response("head_bucket", {}, {"Bucket": "agentbatch-test"})
    assert await client.discover()
    bstub.add_client_error("list_model_invocation_jobs", "AccessDeniedException",
                           "User is not authorized", http_status_code=403)
    with pytest.raises(BatchSpecError, match="AccessDeniedException") as caught:
        await client.discover()
    assert SECRET not in str(caught.value) and "AKIAFAKE" not in str(caught.value)


async def test_a_throttled_upload_is_a_retryable_error_without_credentials(
        client: BedrockBatchClient, stubs: tuple[Stubber, Stubber, Any, Any]) -> None:
    stubs[1].add_client_error("put_object", "SlowDown", "Please reduce your request rate",
                              http_status_code=503)
    with pytest.raises(ServerError, match="put_object: SlowDown") as caught:
        await client.submit([("a", request("a")), ("b", request("b"))])
    assert caught.value.retryable
    assert SECRET not in str(caught.value) and "AKIAFAKE" not in str(caught.value)


def test_record_error_codes_map_to_item_error_kinds() -> None:
    assert bb._error_kind(429) == "rate_limited" and bb._error_kind("503") == "server_error"
    assert bb._error_kind(408) == "server_error" and bb._error_kind(400) == "bad_request"
    assert bb._error_kind(None) == "server_error"


def test_pricing_batch_on_unconfigured_bedrock_is_refused_before_any_turn(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the embedded engine's own warm-up: the refusal names both variables, and no
    connection is ever opened (a model turn would have to connect to AWS)."""
    def no_network(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a connection was attempted")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    with pytest.raises(BatchSpecError) as caught:
        run_batch("Say hi to {name}", [{"name": "Ada"}], model=MODEL,
                  backend=f"bedrock://us-east-1/{MODEL}", pricing="batch", progress=False)
    message = str(caught.value)
    assert bb.S3_ENV in message and bb.ROLE_ENV in message
    assert SECRET not in message and "AKIAFAKE" not in message


def test_an_inline_image_goes_into_the_record_as_base64(client: BedrockBatchClient) -> None:
    png = b"\x89PNG\r\n\x1a\nfake"
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    req = ModelRequest(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": [
        {"type": "text", "text": "What is it?"},
        {"type": "image_url", "image_url": {"url": url}}]}])
    model, data, ids = client.records([("img", req)])
    line = json.loads(data)
    assert (model, ids, line["recordId"]) == (MODEL, {"R0000000000": "img"}, "R0000000000")
    image = line["modelInput"]["messages"][0]["content"][1]["image"]
    assert image == {"format": "png", "source": {"bytes": base64.b64encode(png).decode()}}


async def test_results_read_every_page_of_the_output_listing(
        client: BedrockBatchClient, stubs: tuple[Stubber, Stubber, Any, Any]) -> None:
    bstub, sstub, _, _ = stubs
    prefix = f"{FOLDER}/output/abc123xyz/"
    bstub.add_response("get_model_invocation_job", job("Completed"), {"jobIdentifier": JOB})
    sstub.add_response("get_object", {"Body": body(json.dumps(
        {"R0000000000": "c-a", "R0000000001": "c-b"}).encode())},
        {"Bucket": "agentbatch-test", "Key": f"{FOLDER}/ids.json"})
    sstub.add_response("list_objects_v2", {"Contents": [{"Key": prefix + "one.jsonl.out"}],
                                           "IsTruncated": True, "NextContinuationToken": "n1"},
                       {"Bucket": "agentbatch-test", "Prefix": prefix})
    sstub.add_response("list_objects_v2", {"Contents": [{"Key": prefix + "two.jsonl.out"}],
                                           "IsTruncated": False},
                       {"Bucket": "agentbatch-test", "Prefix": prefix, "ContinuationToken": "n1"})
    for key, rid, text in (("one", "R0000000000", "A"), ("two", "R0000000001", "B")):
        line = {"recordId": rid, "modelOutput": converse_output(text, 1, 1)}
        sstub.add_response("get_object", {"Body": body(json.dumps(line).encode())},
                           {"Bucket": "agentbatch-test", "Key": f"{prefix}{key}.jsonl.out"})
    found = await client.results(JOB, ["c-a", "c-b"])
    replies = [found[c].response for c in ("c-a", "c-b")]
    assert [r.text if r is not None else None for r in replies] == ["A", "B"]


def test_batch_sizes_callers_gather_per_provider(client: BedrockBatchClient) -> None:
    """OpenAI and Anthropic keep the engines' small batches (any size is accepted); a Bedrock
    job takes between its quota's minimum and maximum records."""
    for cls in (OpenAIBatchClient, AnthropicBatchClient):
        assert (cls.min_items, cls.max_items) == (1, DEFAULT_MAX_ITEMS)
    assert (OpenAIBatchClient.quota_max_items,
            AnthropicBatchClient.quota_max_items) == (50_000, 100_000)
    assert (client.min_items, client.max_items, client.quota_max_items) == (2, 50_000, 50_000)


async def test_a_batch_above_the_quota_is_refused_before_any_upload(
        backend: BedrockBackend, stubs: tuple[Stubber, Stubber, Any, Any]) -> None:
    small = bedrock_batch_client(backend, env=ENV | {bb.MAX_ENV: "3"}, bedrock=stubs[2],
                                 s3=stubs[3])
    with pytest.raises(BatchSpecError, match=r"at most 3 requests per batch.*got 4"):
        await small.submit([(f"c{n}", request("Hi")) for n in range(4)])


async def test_discover_during_an_aws_outage_is_retryable_not_a_spec_error(
        client: BedrockBatchClient, stubs: tuple[Stubber, Stubber, Any, Any]) -> None:
    stubs[0].add_client_error("list_model_invocation_jobs", "ThrottlingException",
                              "Rate exceeded", http_status_code=429)
    with pytest.raises(RateLimited) as caught:
        await client.discover()
    assert caught.value.retryable
