"""API keys go only where their owner sent them (issue 8 item 8).

A local server on 127.0.0.1 records every request's headers. ``OPENAI_API_KEY`` from the
environment must never reach it through an ``openai://127.0.0.1:port`` URL -- neither from the
submitting process nor from a worker running someone else's plan. A key named for that host
explicitly (``AGENTBATCH_API_KEYS`` on the side that sends) arrives, and only that key.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from agentbatch import ConfigError, run_batch, submit_batch
from tests.support.recording_http import RecordingServer

ENV_KEY = "sk-env-SECRET-must-not-leave"
LOCAL_KEY = "sk-local-for-this-host"


@pytest.fixture
def server() -> Iterator[RecordingServer]:
    srv = RecordingServer().start()
    yield srv
    srv.stop()


def test_env_key_is_not_sent_to_a_non_official_host(
        server: RecordingServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", ENV_KEY)
    monkeypatch.delenv("AGENTBATCH_API_KEYS", raising=False)
    with pytest.raises(ConfigError, match="AGENTBATCH_API_KEYS") as info:
        run_batch("Say {x}.", [{"x": 1}], backend=f"openai://{server.netloc}", model="m")
    assert ENV_KEY not in str(info.value)
    assert server.requests == []  # refused before anything was sent


def test_key_named_for_the_host_is_the_one_sent(
        server: RecordingServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", ENV_KEY)
    monkeypatch.setenv("LOCAL_LLM_KEY", LOCAL_KEY)
    monkeypatch.setenv("AGENTBATCH_API_KEYS", json.dumps({server.netloc: "LOCAL_LLM_KEY"}))
    results = run_batch("Say {x}.", [{"x": i} for i in range(3)],
                        backend=f"openai://{server.netloc}", model="m")
    assert all(r.ok for r in results), [r.error for r in results]
    assert server.authorizations() == [f"Bearer {LOCAL_KEY}"] * 3


def test_url_key_env_option_names_the_variable_in_the_submitting_process(
        server: RecordingServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", ENV_KEY)
    monkeypatch.setenv("LOCAL_LLM_API_KEY", LOCAL_KEY)  # *_API_KEY: see check_key_env
    monkeypatch.delenv("AGENTBATCH_API_KEYS", raising=False)
    results = run_batch("Say {x}.", [{"x": 1}],
                        backend=f"openai://{server.netloc}?api_key_env=LOCAL_LLM_API_KEY",
                        model="m")
    assert results[0].ok, results[0].error
    assert server.authorizations() == [f"Bearer {LOCAL_KEY}"]


def test_anthropic_env_key_is_not_sent_to_a_non_official_host(
        server: RecordingServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", ENV_KEY)
    monkeypatch.delenv("AGENTBATCH_API_KEYS", raising=False)
    with pytest.raises(ConfigError, match="AGENTBATCH_API_KEYS"):
        run_batch("Say {x}.", [{"x": 1}], backend=f"anthropic://{server.netloc}", model="m")
    monkeypatch.setenv("LOCAL_LLM_KEY", LOCAL_KEY)
    monkeypatch.setenv("AGENTBATCH_API_KEYS", json.dumps({server.netloc: "LOCAL_LLM_KEY"}))
    results = run_batch("Say {x}.", [{"x": 1}], backend=f"anthropic://{server.netloc}",
                        model="m")
    assert results[0].ok, results[0].error
    assert server.authorizations() == [LOCAL_KEY]


@pytest.mark.redis
@pytest.mark.slow
def test_workers_keys_go_only_where_the_worker_says(
        server: RecordingServer, redis_url: str, start_workers,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker has OPENAI_API_KEY. A plan names the local host (from a submitter with no
    key), then asks for the worker's OPENAI_API_KEY by name (from a submitter holding a dummy
    key of its own, so its own check passes): the worker sends its key in neither case."""
    monkeypatch.delenv("AGENTBATCH_API_KEYS", raising=False)
    start_workers(1, concurrency=4, env={"OPENAI_API_KEY": ENV_KEY})
    for url, submitter_key in ((f"openai://{server.netloc}", None),
                               (f"openai://{server.netloc}?api_key_env=OPENAI_API_KEY", "dummy")):
        if submitter_key is None:
            monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        else:
            monkeypatch.setenv("OPENAI_API_KEY", submitter_key)
        handle = submit_batch("Say {x}.", [{"x": 1}], backend=url, model="m",
                              redis_url=redis_url)
        results = handle.wait(timeout=120)
        assert not results[0].ok
        assert "AGENTBATCH_API_KEYS" in str(results[0].error), results[0].error
        assert ENV_KEY not in str(results[0].error)
    assert ENV_KEY not in str(server.authorizations())


@pytest.mark.redis
@pytest.mark.slow
def test_worker_sends_the_key_its_own_mapping_names(
        server: RecordingServer, redis_url: str, start_workers,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("AGENTBATCH_API_KEYS", raising=False)
    start_workers(1, concurrency=4, env={
        "OPENAI_API_KEY": ENV_KEY, "LOCAL_LLM_KEY": LOCAL_KEY,
        "AGENTBATCH_API_KEYS": json.dumps({server.netloc: "LOCAL_LLM_KEY"}),
    })
    handle = submit_batch("Say {x}.", [{"x": i} for i in range(4)],
                          backend=f"openai://{server.netloc}", model="m", redis_url=redis_url)
    results = handle.wait(timeout=120)
    assert all(r.ok for r in results), [r.error for r in results]
    assert server.authorizations() == [f"Bearer {LOCAL_KEY}"] * 4
