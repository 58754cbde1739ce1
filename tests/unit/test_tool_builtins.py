"""Built-in tools: read_file confinement, web_search providers, http_get on a local server."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from agentbatch.core.errors import ToolError
from agentbatch.core.model_io import ToolCall
from agentbatch.toolpool import (
    Tool,
    ToolContext,
    ToolPool,
    read_file_tool,
    resolve_tool,
    set_web_search_provider,
)
from agentbatch.toolpool.builtins import FILE_ROOT_ENV, WEB_SEARCH_PROVIDER_ENV
from tests.support.http_server import ThreadedServer

CTX = ToolContext.for_call("batch", 0, 0, "c0")
NO_PROVIDER = (
    "web_search has no provider configured: set AGENTBATCH_WEB_SEARCH_PROVIDER=module:function "
    "or call agentbatch.toolpool.set_web_search_provider(fn)"
)


async def run(tool: Tool, **arguments: Any) -> Any:
    return await ToolPool([tool]).run(ToolCall(id="c0", name=tool.name, arguments=arguments), CTX)


# -- read_file -----------------------------------------------------------------------------


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """tmp/root/{a.txt, sub/b.txt} inside the root, tmp/outside.txt outside it."""
    base = tmp_path / "root"
    (base / "sub").mkdir(parents=True)
    (base / "a.txt").write_text("alpha", encoding="utf-8")
    (base / "sub" / "b.txt").write_text("beta", encoding="utf-8")
    (tmp_path / "outside.txt").write_text("secret", encoding="utf-8")
    monkeypatch.setenv(FILE_ROOT_ENV, str(base))
    return base


async def test_read_file_inside_root(root: Path) -> None:
    assert Tool.read_file("a.txt") == "alpha"
    assert Tool.read_file("sub/b.txt") == "beta"
    assert Tool.read_file("sub/../a.txt") == "alpha"  # '..' that stays inside is fine
    assert Tool.read_file(str(root / "sub" / "b.txt")) == "beta"  # absolute, inside
    outcome = await run(Tool.read_file, path="a.txt")
    assert outcome.ok and outcome.content == "alpha"


async def test_read_file_refuses_dotdot_traversal(root: Path) -> None:
    with pytest.raises(ToolError, match="outside the allowed root"):
        Tool.read_file("../outside.txt")
    outcome = await run(Tool.read_file, path="sub/../../outside.txt")
    assert not outcome.ok and "outside the allowed root" in outcome.content
    assert "secret" not in outcome.content


def test_read_file_refuses_absolute_path_outside(root: Path) -> None:
    with pytest.raises(ToolError, match="outside the allowed root"):
        Tool.read_file(str(root.parent / "outside.txt"))
    with pytest.raises(ToolError, match="outside the allowed root"):
        Tool.read_file("/etc/passwd")


def test_read_file_refuses_escaping_symlinks(root: Path) -> None:
    (root / "leak").symlink_to(root.parent / "outside.txt")
    (root / "updir").symlink_to(root.parent, target_is_directory=True)
    with pytest.raises(ToolError, match="outside the allowed root"):
        Tool.read_file("leak")
    with pytest.raises(ToolError, match="outside the allowed root"):
        Tool.read_file("updir/outside.txt")


def test_read_file_follows_symlinks_inside_root(root: Path) -> None:
    (root / "alias").symlink_to(root / "sub" / "b.txt")
    (root / "subalias").symlink_to(root / "sub", target_is_directory=True)
    assert Tool.read_file("alias") == "beta"
    assert Tool.read_file("subalias/b.txt") == "beta"


def test_read_file_errors_and_truncation(root: Path) -> None:
    with pytest.raises(ToolError, match="no such file"):
        Tool.read_file("missing.txt")
    with pytest.raises(ToolError, match="is a directory"):
        Tool.read_file("sub")
    (root / "bin").write_bytes(b"\xff\xfeok" + b"z" * 100)
    text = Tool.read_file("bin", max_bytes=4)
    assert text.startswith("\ufffd\ufffdok")
    assert "[truncated: showing the first 4 of 104 bytes]" in text


def test_read_file_has_no_default_root(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FILE_ROOT_ENV)
    monkeypatch.chdir(root / "sub")
    with pytest.raises(ToolError, match="AGENTBATCH_FILE_ROOT"):
        Tool.read_file("b.txt")


def test_read_file_tool_with_explicit_root(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(FILE_ROOT_ENV)
    confined = read_file_tool(root / "sub")
    assert confined.name == "read_file" and confined.import_path is None and confined.cacheable
    assert confined.openai_schema() == Tool.read_file.openai_schema()
    assert confined("b.txt") == "beta"
    with pytest.raises(ToolError, match="outside the allowed root"):
        confined("../a.txt")


def test_builtins_are_reimportable() -> None:
    for t in (Tool.read_file, Tool.http_get, Tool.web_search):
        assert t.import_path == f"agentbatch.toolpool.builtins:{t.name}"
        assert resolve_tool(t.import_path) is t
    assert Tool.read_file.cacheable and Tool.web_search.cacheable and not Tool.http_get.cacheable


# -- web_search ----------------------------------------------------------------------------


@pytest.fixture
def no_provider(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(WEB_SEARCH_PROVIDER_ENV, raising=False)
    set_web_search_provider(None)
    yield
    set_web_search_provider(None)


def fake_provider(query: str, max_results: int) -> list[dict[str, Any]]:
    return [{"title": f"{query} {i}", "url": f"https://example.invalid/{i}"} for i in range(10)]


async def test_web_search_without_provider_says_how_to_configure(no_provider: None) -> None:
    outcome = await run(Tool.web_search, query="q")
    assert not outcome.ok and outcome.content == NO_PROVIDER


async def test_web_search_with_a_provider(no_provider: None) -> None:
    calls: list[tuple[str, int]] = []

    def provider(query: str, max_results: int) -> list[dict[str, Any]]:
        calls.append((query, max_results))
        return fake_provider(query, max_results)

    set_web_search_provider(provider)
    pool = ToolPool([Tool.web_search])
    search = ToolCall(id="c0", name="web_search", arguments={"query": "cats", "max_results": 2})
    first = await pool.run(search, CTX)
    assert first.ok
    assert first.content == (
        '[{"title":"cats 0","url":"https://example.invalid/0"},'
        '{"title":"cats 1","url":"https://example.invalid/1"}]'
    )
    assert (await pool.run(search, CTX)).cached and calls == [("cats", 2)]


async def test_web_search_async_provider_and_env_provider(
    no_provider: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def provider(query: str, max_results: int) -> str:
        return f"text results for {query}"

    set_web_search_provider(provider)
    assert (await run(Tool.web_search, query="dogs")).content == "text results for dogs"
    set_web_search_provider(None)
    monkeypatch.setenv(WEB_SEARCH_PROVIDER_ENV, f"{__name__}:fake_provider")
    outcome = await run(Tool.web_search, query="env")
    assert outcome.ok and '"title":"env 4"' in outcome.content and "env 5" not in outcome.content
    monkeypatch.setenv(WEB_SEARCH_PROVIDER_ENV, "no_such_module_xyz:search")
    outcome = await run(Tool.web_search, query="env")
    assert not outcome.ok and "cannot load provider" in outcome.content


# -- http_get ------------------------------------------------------------------------------


async def _answer(request: web.Request) -> web.Response:
    if request.path == "/missing":
        status, body = 404, b"not here"
    elif request.path == "/big":
        status, body = 200, b"x" * 5000
    else:
        status, body = 200, "héllo wörld".encode()
    return web.Response(status=status, body=body, content_type="text/plain", charset="utf-8")


@pytest.fixture
def local_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """No proxies from the environment: test requests must stay on 127.0.0.1."""
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
                "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("AGENTBATCH_HTTP_ALLOW", "127.0.0.1")  # loopback is refused by default


@pytest.fixture
def server(local_only: None) -> Iterator[str]:
    """A tiny HTTP server on 127.0.0.1:<free port>, in a thread."""
    with ThreadedServer(lambda app: app.router.add_get("/{tail:.*}", _answer)) as httpd:
        yield httpd.http_url


async def test_http_get_returns_status_and_text(server: str) -> None:
    outcome = await run(Tool.http_get, url=f"{server}/hello")
    assert outcome.ok
    assert outcome.content.startswith("HTTP 200 OK\ncontent-type: text/plain; charset=utf-8\n\n")
    assert outcome.content.endswith("héllo wörld")
    missing = await run(Tool.http_get, url=f"{server}/missing")
    assert missing.ok and missing.content.startswith("HTTP 404") and "not here" in missing.content


async def test_http_get_truncates(server: str) -> None:
    outcome = await run(Tool.http_get, url=f"{server}/big", max_bytes=100)
    assert outcome.ok and outcome.content.endswith("x" * 100 + "\n[truncated after 100 bytes]")


async def test_http_get_refuses_other_schemes() -> None:
    for url in ("file:///etc/passwd", "ftp://example.invalid/x", "not a url"):
        outcome = await run(Tool.http_get, url=url)
        assert not outcome.ok and "only http:// and https://" in outcome.content, url


async def test_http_get_connection_failure_is_an_error_outcome(local_only: None) -> None:
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    outcome = await run(Tool.http_get, url=f"http://127.0.0.1:{port}/")
    assert not outcome.ok and "request to" in outcome.content and "failed" in outcome.content
