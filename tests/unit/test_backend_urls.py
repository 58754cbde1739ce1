"""Backend URL parsing and the scheme registry."""

from __future__ import annotations

import pytest

from agentbatch.backends.registry import backend_from_url
from agentbatch.backends.urls import KNOWN_SCHEMES, BackendTarget, parse_backend_url
from agentbatch.core.errors import BatchSpecError, ConfigError


@pytest.fixture(autouse=True)
def _no_openai_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)


@pytest.mark.parametrize("scheme", ["vllm", "sglang", "dynamo", "sim", "llamacpp"])
def test_self_hosted_schemes_map_to_http(scheme: str) -> None:
    t = parse_backend_url(f"{scheme}://gpu-box:8000")
    assert t == BackendTarget(scheme, "http://gpu-box:8000", f"{scheme}://gpu-box:8000")
    assert t.region is None and t.model is None and t.api_key is None
    assert t.display == f"{scheme}://gpu-box:8000"


@pytest.mark.parametrize(
    "url",
    [
        "vllm://h:8000/v1",
        "vllm://h:8000/v1/",
        "vllm://h:8000/",
        "vllm://h:8000",
        "VLLM://h:8000/v1",
    ],
)
def test_v1_suffix_and_trailing_slash_are_stripped(url: str) -> None:
    t = parse_backend_url(url)
    assert t.base_url == "http://h:8000"
    assert t.raw == url


def test_plus_https_selects_tls() -> None:
    t = parse_backend_url("vllm+https://gpu.example.com/v1")
    assert (t.scheme, t.base_url) == ("vllm", "https://gpu.example.com")
    assert parse_backend_url("sglang+http://h:30000").base_url == "http://h:30000"


def test_plain_http_and_https_are_generic_openai_compatible() -> None:
    assert parse_backend_url("http://127.0.0.1:8000/v1") == BackendTarget(
        "http", "http://127.0.0.1:8000", "http://127.0.0.1:8000/v1"
    )
    t = parse_backend_url("https://proxy.example.com/llm/v1")
    assert (t.scheme, t.base_url) == ("http", "https://proxy.example.com/llm")
    assert t.display == "https://proxy.example.com/llm"


def test_ipv6_host_keeps_brackets() -> None:
    assert parse_backend_url("vllm://[::1]:8000").base_url == "http://[::1]:8000"


def test_model_query_parameter() -> None:
    t = parse_backend_url("vllm://h:8000/v1?model=qwen")
    assert (t.base_url, t.model) == ("http://h:8000", "qwen")


def test_openai_default_host_requires_key_and_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="OPENAI_API_KEY"):
        parse_backend_url("openai://")


def test_openai_key_from_env_is_kept_out_of_repr(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test-secret-value")
    t = parse_backend_url("openai://")
    assert t.base_url == "https://api.openai.com"
    assert t.api_key == "sk-test-secret-value"
    assert "sk-test" not in repr(t)
    assert parse_backend_url("openai:///v1").base_url == "https://api.openai.com"


def test_openai_explicit_key_wins_over_missing_env() -> None:
    t = parse_backend_url("openai://", api_key="sk-explicit")
    assert t.api_key == "sk-explicit"


def test_openai_custom_host_https_unless_loopback_and_key_optional() -> None:
    t = parse_backend_url("openai://llm.example.com")
    assert (t.scheme, t.base_url, t.api_key) == ("openai", "https://llm.example.com", None)
    assert parse_backend_url("openai://localhost:8080/v1").base_url == "http://localhost:8080"
    assert parse_backend_url("openai://127.0.0.2:9").base_url == "http://127.0.0.2:9"
    assert parse_backend_url("openai+http://box:80").base_url == "http://box:80"


def test_openai_host_explicitly_named_still_needs_key() -> None:
    with pytest.raises(ConfigError, match="OPENAI_API_KEY"):
        parse_backend_url("openai://api.openai.com/v1")


def test_anthropic_is_recognised() -> None:
    t = parse_backend_url("anthropic://")
    assert (t.scheme, t.base_url) == ("anthropic", "https://api.anthropic.com")


def test_bedrock_region_and_model() -> None:
    t = parse_backend_url("bedrock://us-east-1/anthropic.claude-3-5-sonnet-20240620-v1:0")
    assert t.scheme == "bedrock"
    assert t.region == "us-east-1"
    assert t.model == "anthropic.claude-3-5-sonnet-20240620-v1:0"
    assert t.base_url == "https://bedrock-runtime.us-east-1.amazonaws.com"
    assert parse_backend_url("bedrock://eu-west-3").model is None


@pytest.mark.parametrize("url", ["bedrock://", "bedrock:///some-model"])
def test_bedrock_without_region(url: str) -> None:
    with pytest.raises(
        BatchSpecError, match=r"bedrock:// URL needs a region, e.g. bedrock://us-east-1"
    ):
        parse_backend_url(url)


def test_bedrock_rejects_a_non_region() -> None:
    with pytest.raises(BatchSpecError, match="AWS region"):
        parse_backend_url("bedrock://my-model-name/x")


def test_unknown_scheme_names_it_and_lists_known_ones() -> None:
    with pytest.raises(BatchSpecError) as info:
        parse_backend_url("tgi://h:8080")
    msg = str(info.value)
    assert "'tgi'" in msg
    for scheme in KNOWN_SCHEMES:
        assert f"{scheme}://" in msg


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("localhost:8000", "no scheme"),
        ("vllm://", "needs a host"),
        ("http://", "needs a host"),
        ("vllm://h:notaport", "invalid port"),
        ("vllm+ftp://h:1", "unknown backend scheme"),
        ("https://user:sk-secret@h/v1", "credentials"),
    ],
)
def test_malformed_urls(url: str, match: str) -> None:
    with pytest.raises(BatchSpecError, match=match) as info:
        parse_backend_url(url)
    assert "sk-secret" not in str(info.value)


def test_spec_errors_are_value_errors() -> None:
    with pytest.raises(ValueError):
        parse_backend_url("nope://x")


# -- registry ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "cls_name"),
    [
        ("vllm://h:1", "VLLMBackend"),
        ("sglang://h:1", "OpenAICompatBackend"),
        ("sim://h:1", "OpenAICompatBackend"),
        ("http://h:1/v1", "OpenAICompatBackend"),
        ("openai://localhost:1", "OpenAICompatBackend"),
        ("dynamo://h:1", "DynamoBackend"),
        ("llamacpp://h:1", "LlamaCppBackend"),
    ],
)
async def test_registry_picks_driver_by_scheme(url: str, cls_name: str) -> None:
    backend = backend_from_url(url, timeout=7.0, max_connections=3)
    try:
        assert type(backend).__name__ == cls_name
        assert backend.timeout == 7.0
        assert backend.max_connections == 3
    finally:
        await backend.aclose()


async def test_registry_capabilities_per_scheme() -> None:
    caps = {
        s: backend_from_url(f"{s}://h:1").capabilities for s in ("vllm", "sglang", "dynamo", "sim")
    }
    assert all(c.native_json_schema and c.prefix_warming for c in caps.values())
    # vLLM (and the simulator, which models it) shares a prefix among requests in flight
    assert [s for s, c in caps.items() if c.prefix_shared_in_flight] == ["vllm", "sim"]
    assert [s for s, c in caps.items() if c.agent_hints] == ["dynamo"]
    assert not caps["dynamo"].batch_prompting
    assert caps["vllm"].batch_prompting and caps["sglang"].batch_prompting
    assert caps["vllm"].prefix_cache_metrics and caps["sglang"].prefix_cache_metrics
    openai = backend_from_url("openai://", api_key="sk-x").capabilities
    assert openai.native_json_schema and openai.max_safe_concurrency == 64
    assert not (openai.prefix_warming or openai.prefix_cache_metrics or openai.batch_prompting)
    llamacpp = backend_from_url("llamacpp://h:1").capabilities
    assert llamacpp.native_json_schema and llamacpp.batch_prompting
    assert llamacpp.prefix_cache_metrics and not llamacpp.tool_choice_required


@pytest.mark.parametrize(
    ("url", "cls"),
    [("anthropic://", "AnthropicBackend"), ("bedrock://us-east-1/m", "BedrockBackend")],
)
def test_registry_hosted_drivers(url: str, cls: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-x")
    assert type(backend_from_url(url)).__name__ == cls


def test_registry_scheme_without_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    from agentbatch.backends import registry

    monkeypatch.delitem(registry._DRIVERS, "anthropic")
    with pytest.raises(ConfigError, match="not implemented yet"):
        backend_from_url("anthropic://")


def test_registry_api_key_argument_satisfies_openai() -> None:
    backend = backend_from_url("openai://", api_key="sk-abc")
    assert backend.name == "openai://api.openai.com"
    assert "sk-abc" not in repr(backend)


def test_registry_missing_openai_key() -> None:
    with pytest.raises(ConfigError, match="OPENAI_API_KEY"):
        backend_from_url("openai://")


@pytest.mark.parametrize(
    "url",
    [
        "sim://[::1:18441",
        "vllm://[::1",
        "http://[::1",
        "openai://[::1",
        "anthropic://[x",
        "sim://::1]:80",
        "sim://[zz]:80",
        "vllm://[::1]x:80",
        "llamacpp://[::1]junk",
        "https://user:sk-secret@[::1:80/v1",
    ],
)
def test_malformed_host_names_the_url(url: str) -> None:
    """A broken IPv6 literal is a spec error naming the backend URL, never a raw ValueError
    from urlsplit (which the CLI would show as a traceback)."""
    with pytest.raises(BatchSpecError, match="backend URL") as info:
        parse_backend_url(url)
    assert "host" in str(info.value)
    assert "sk-secret" not in str(info.value)
