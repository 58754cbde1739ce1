"""open_backend's wrapping order, hostfiles, and EndpointPool routing over fake backends."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agentbatch.backends.aimd import AdaptiveBackend
from agentbatch.backends.base import Backend, ServerLoad
from agentbatch.backends.openai_compat import OpenAICompatBackend
from agentbatch.backends.pool import EndpointPool, parse_hostfile
from agentbatch.backends.retry import RetryingBackend
from agentbatch.backends.setup import endpoints, expand_backend_urls, inflight_hint, open_backend
from agentbatch.core.errors import BackendUnavailable, BatchSpecError
from agentbatch.core.model_io import ModelRequest
from tests.support.fake_backend import Outcome, ScriptedBackend


def test_self_hosted_is_retrying_over_the_driver() -> None:
    backend = open_backend(["vllm://127.0.0.1:1"])
    assert isinstance(backend, RetryingBackend)
    assert isinstance(backend.inner, OpenAICompatBackend)


@pytest.mark.parametrize("url", ["openai://", "anthropic://", "bedrock://us-east-1/m"])
def test_hosted_is_retrying_over_adaptive(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-x")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-x")
    backend = open_backend([url])
    assert isinstance(backend, RetryingBackend)
    adaptive = backend.inner
    assert isinstance(adaptive, AdaptiveBackend)
    safe = adaptive.capabilities.max_safe_concurrency
    assert adaptive.limit == safe and adaptive.controller.maximum >= safe


def test_hostfile_parsing(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text(
        "# the fleet\n"
        "10.0.0.5:8000\n"
        "\n"
        "  vllm://10.0.0.6:8000   # second box\n"
        "sglang+https://gpu.example:443\n"
    )
    assert parse_hostfile(hosts) == [
        "http://10.0.0.5:8000",
        "vllm://10.0.0.6:8000",
        "sglang+https://gpu.example:443",
    ]
    assert parse_hostfile(hosts, default_scheme="vllm")[0] == "vllm://10.0.0.5:8000"
    (tmp_path / "empty").write_text("# nothing\n\n")
    with pytest.raises(BatchSpecError, match="lists no endpoints"):
        parse_hostfile(tmp_path / "empty")
    with pytest.raises(BatchSpecError, match="cannot read hostfile"):
        parse_hostfile(tmp_path / "missing")


def test_open_backend_expands_hostfiles_into_a_pool(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("vllm://127.0.0.1:1\n127.0.0.1:2\n")
    assert expand_backend_urls([f"@{hosts}", "sim://127.0.0.1:3"]) == [
        "vllm://127.0.0.1:1",
        "http://127.0.0.1:2",
        "sim://127.0.0.1:3",
    ]
    backend = open_backend([f"@{hosts}"])
    assert isinstance(backend, RetryingBackend)
    pool = backend.inner
    assert isinstance(pool, EndpointPool)
    assert [b.name for b in pool.backends] == ["vllm://127.0.0.1:1", "http://127.0.0.1:2"]
    assert pool.capabilities.prefix_warming  # the first endpoint's (vllm)


class Fake(ScriptedBackend):
    """Answers its own name; while ``down``, refuses every call."""

    def __init__(self, name: str, load: ServerLoad | None = None) -> None:
        super().__init__(name=name, reply=name, load=load)
        self.down = False

    def outcome(self, request: ModelRequest) -> Outcome:
        if self.down:
            return BackendUnavailable(f"{self.name} refused")
        return super().outcome(request)


REQ = ModelRequest(model="m", messages=[{"role": "user", "content": "x"}], agent_key="a")


async def test_pool_probe_readmits_with_injected_sleep() -> None:
    a, b = Fake("a"), Fake("b")
    slept: list[float] = []
    ticks: asyncio.Queue[None] = asyncio.Queue()

    async def sleep(seconds: float) -> None:  # the test decides when a probe interval ends
        slept.append(seconds)
        await ticks.get()

    async def settle() -> None:
        for _ in range(10):
            await asyncio.sleep(0)

    pool = EndpointPool([b, a], eject_after=1, probe_interval_s=7.0, sleep=sleep)
    assert isinstance(pool, Backend)
    b.down, b.healthy = True, False
    with pytest.raises(BackendUnavailable):
        await pool.complete(REQ)  # the first agent lands on b, which refuses: ejected
    assert (await pool.complete(REQ)).text == "a"  # its retry goes to a
    await settle()
    assert pool.stats()["b"]["ejected"] and slept == [7.0]
    ticks.put_nowait(None)  # one interval: still unhealthy, stays out
    await settle()
    assert pool.stats()["b"]["ejected"] and slept == [7.0, 7.0]
    b.down, b.healthy = False, True
    ticks.put_nowait(None)
    await settle()
    assert not pool.stats()["b"]["ejected"]
    await pool.aclose()
    assert a.closed and b.closed


async def test_pool_sums_loads_and_names_duplicates() -> None:
    a = Fake("same", ServerLoad(running=2, waiting=1, prefix_cache_hit_rate=0.5))
    b = Fake("same", ServerLoad(running=3, waiting=0, prefix_cache_hit_rate=0.7))
    c = Fake("other", None)
    pool = EndpointPool([a, b, c])
    load = await pool.fetch_load()
    assert load is not None and (load.running, load.waiting) == (5, 1)
    assert load.prefix_cache_hit_rate == pytest.approx(0.6)
    assert list(pool.stats()) == ["same", "same'", "other"]
    assert await EndpointPool([c]).fetch_load() is None
    with pytest.raises(ValueError):
        EndpointPool([])


def test_inflight_hint_is_the_slot_count_summed_over_a_pool_once_props_are_known() -> None:
    one = open_backend(["llamacpp://127.0.0.1:1"])
    assert inflight_hint(one) is None  # /props not read yet: no opinion
    pool = open_backend(["llamacpp://127.0.0.1:1", "llamacpp://127.0.0.1:2"])
    for i, endpoint in enumerate(endpoints(pool)):
        endpoint._props = {"total_slots": 4 + i}  # what preflight read from /props
    assert inflight_hint(pool) == 9
    mixed = open_backend(["llamacpp://127.0.0.1:1", "vllm://127.0.0.1:2"])
    endpoints(mixed)[0]._props = {"total_slots": 4}
    assert inflight_hint(mixed) is None  # vLLM keeps its own queue: no cap from us
