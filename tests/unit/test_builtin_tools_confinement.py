"""read_file needs a root and never reads /proc, /sys, /dev; http_get is no SSRF tool.

HTTP traffic in these tests goes to loopback only: a local aiohttp server, reached only when
the test allows it explicitly. Any request that would leave loopback is stopped by the
``transport_log`` fixture before a connection is made, and recorded, so a test can assert
that none was attempted.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from agentbatch.core.errors import ToolError
from agentbatch.core.model_io import ToolCall
from agentbatch.toolpool import Tool, ToolContext, ToolPool, read_file_tool
from agentbatch.toolpool.builtins import FILE_ROOT_ENV
from agentbatch.toolpool.confined_read import read_confined
from agentbatch.toolpool.public_http import (
    HTTP_ALLOW_ENV,
    address_refusal,
    http_allowlist,
)
from tests.support.recording_http import RecordingServer

CTX = ToolContext.for_call("batch", 0, 0, "c0")


async def run(tool: Tool, **arguments: Any) -> Any:
    return await ToolPool([tool]).run(ToolCall(id="c0", name=tool.name, arguments=arguments), CTX)


# -- read_file -----------------------------------------------------------------------------


def test_read_file_without_root_refuses_and_says_how(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "here.txt").write_text("cwd file")
    monkeypatch.delenv(FILE_ROOT_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ToolError, match="AGENTBATCH_FILE_ROOT=/path/to/files"):
        Tool.read_file("here.txt")
    monkeypatch.chdir("/")  # systemd's default working directory
    with pytest.raises(ToolError, match="no root directory configured"):
        Tool.read_file("proc/self/environ")


@pytest.mark.parametrize("path", [
    "proc/self/environ", "/proc/self/environ", "proc/1/cmdline", "/proc/self/status",
    "sys/kernel/hostname", "/sys/class", "dev/null", "/dev/zero", "etc/../proc/version",
])  # fmt: skip
def test_read_file_never_reads_proc_sys_dev_even_under_root_slash(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FILE_ROOT_ENV, "/")
    monkeypatch.setenv("AGENTBATCH_CONFINEMENT_CANARY", "canary-value-123")
    with pytest.raises(ToolError) as info:
        Tool.read_file(path)
    assert "/proc, /sys and /dev are never readable" in str(info.value), str(info.value)
    assert "canary-value-123" not in str(info.value)


def test_read_file_root_inside_proc_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ToolError, match="never readable"):
        read_confined("/proc/self", "environ")
    with pytest.raises(ToolError, match="never readable"):
        read_file_tool("/dev")("null")


def test_symlinks_into_proc_are_refused(tmp_path: Path) -> None:
    (tmp_path / "env").symlink_to("/proc/self/environ")
    (tmp_path / "procdir").symlink_to("/proc", target_is_directory=True)
    for name in ("env", "procdir/self/environ"):
        with pytest.raises(ToolError, match="outside the allowed root"):
            read_confined(tmp_path, name)
    with pytest.raises(ToolError, match="never readable"):
        read_confined("/", str(tmp_path / "env"))  # root=/: the link lands in /proc


def test_read_file_under_root_slash_still_reads_ordinary_files(tmp_path: Path) -> None:
    (tmp_path / "ok.txt").write_text("fine")
    assert read_confined("/", str(tmp_path / "ok.txt")) == "fine"
    assert read_confined("/", str(tmp_path / "ok.txt").lstrip("/")) == "fine"


def test_relative_symlink_chains_stay_beneath_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "f.txt").write_text("deep")
    (tmp_path / "secret.txt").write_text("secret")
    (root / "a" / "up").symlink_to("..", target_is_directory=True)
    (root / "a" / "b" / "hop").symlink_to("../up/a/b/f.txt")
    (root / "a" / "b" / "out").symlink_to("../../../secret.txt")
    (root / "loop").symlink_to("loop")
    assert read_confined(root, "a/b/hop") == "deep"
    with pytest.raises(ToolError, match="outside the allowed root"):
        read_confined(root, "a/b/out")
    with pytest.raises(ToolError, match="too many symlinks"):
        read_confined(root, "loop")


def test_fifo_and_other_special_files_are_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "pipe")  # opening a FIFO for reading would block without a writer
    with pytest.raises(ToolError, match="not a regular file"):
        read_confined(tmp_path, "pipe")


# -- http_get: the address decision (pure, no traffic) -------------------------------------


@pytest.mark.parametrize("address", [
    "127.0.0.1", "127.1.2.3", "10.0.0.1", "172.16.0.1", "192.168.1.1", "169.254.169.254",
    "169.254.1.1", "100.64.0.1", "100.127.255.254", "0.0.0.0", "224.0.0.1", "240.0.0.1",
    "255.255.255.255", "192.0.0.192", "::1", "::", "fe80::1", "fc00::1", "fd00:ec2::254",
    "ff02::1", "::ffff:127.0.0.1", "::ffff:169.254.169.254", "::ffff:10.0.0.1",
    "64:ff9b::a00:1", "2002:7f00:1::1", "2002:a9fe:a9fe::1",
])  # fmt: skip
def test_non_public_addresses_are_refused(address: str) -> None:
    assert address_refusal("example.com", ipaddress.ip_address(address), http_allowlist(""))


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111"])
def test_public_addresses_pass(address: str) -> None:
    assert address_refusal("example.com", ipaddress.ip_address(address), http_allowlist("")) \
        is None


def test_allowlist_lets_named_hosts_through_but_never_metadata() -> None:
    allow = http_allowlist("127.0.0.1, Internal.Example., 10.1.0.0/16")
    ip = ipaddress.ip_address
    assert address_refusal("127.0.0.1", ip("127.0.0.1"), allow) is None
    assert address_refusal("internal.example", ip("10.9.9.9"), allow) is None
    assert address_refusal("x.example", ip("10.1.2.3"), allow) is None
    assert address_refusal("x.example", ip("10.2.0.1"), allow)
    assert address_refusal("x.example", ip("127.0.0.2"), allow)
    metadata = http_allowlist("169.254.169.254,fd00:ec2::254,metadata.example")
    for a in ("169.254.169.254", "fd00:ec2::254", "::ffff:169.254.169.254"):
        assert "metadata" in str(address_refusal("metadata.example", ip(a), metadata))


# -- http_get against a loopback server ----------------------------------------------------


@pytest.fixture
def transport_log(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every host http_get's transport is asked to reach; non-loopback ones are not reached."""
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
                "all_proxy", HTTP_ALLOW_ENV):
        monkeypatch.delenv(var, raising=False)
    seen: list[str] = []
    real = httpx.AsyncHTTPTransport.handle_async_request

    async def guarded(self: httpx.AsyncHTTPTransport, request: httpx.Request) -> Any:
        host = request.url.host
        seen.append(host)
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = host == "localhost"
        if not loopback:
            raise httpx.ConnectError(f"test guard: no traffic to {host}", request=request)
        return await real(self, request)

    monkeypatch.setattr(httpx.AsyncHTTPTransport, "handle_async_request", guarded)
    yield seen


@pytest.fixture
async def server(transport_log: list[str]) -> AsyncIterator[tuple[int, list[str]]]:
    """An aiohttp server on 127.0.0.1, 127.0.0.2 and ::1 (same port); returns the Host headers
    it saw. /secret is the loopback-only service; /to?url= redirects."""
    hosts: list[str] = []

    async def secret(request: web.Request) -> web.Response:
        hosts.append(request.headers.get("Host", ""))
        return web.Response(text="loopback secret")

    async def to(request: web.Request) -> web.Response:
        hosts.append(request.headers.get("Host", ""))
        raise web.HTTPFound(request.query["url"])

    app = web.Application()
    app.router.add_get("/secret", secret)
    app.router.add_get("/to", to)
    runner = web.AppRunner(app)
    await runner.setup()
    first = web.TCPSite(runner, "127.0.0.1", 0)
    await first.start()
    port = first._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    for host in ("127.0.0.2", "::1"):
        await web.TCPSite(runner, host, port).start()
    try:
        yield port, hosts
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("host", [
    "127.0.0.1", "2130706433", "0x7f000001", "[::1]", "localhost", "127.0.0.2",
    "[::ffff:127.0.0.1]",
])  # fmt: skip
async def test_http_get_refuses_loopback_in_every_spelling(
    server: tuple[int, list[str]], transport_log: list[str], host: str
) -> None:
    port, hosts = server
    outcome = await run(Tool.http_get, url=f"http://{host}:{port}/secret")
    assert not outcome.ok and "refused" in outcome.content, outcome.content
    assert "not a public address" in outcome.content
    assert "loopback secret" not in outcome.content
    assert hosts == [] and transport_log == []  # refused before any connection


async def test_http_get_refuses_a_redirect_to_loopback(
    server: tuple[int, list[str]], transport_log: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """127.0.0.2 stands for an allowed host; its 302 points at 127.0.0.1 (not allowed)."""
    port, hosts = server
    monkeypatch.setenv(HTTP_ALLOW_ENV, "127.0.0.2")
    target = f"http://127.0.0.1:{port}/secret"
    outcome = await run(Tool.http_get, url=f"http://127.0.0.2:{port}/to?url={target}")
    assert not outcome.ok and "not a public address" in outcome.content, outcome.content
    assert "loopback secret" not in outcome.content
    assert transport_log == ["127.0.0.2"] and len(hosts) == 1


@pytest.mark.parametrize("target", [
    "http://169.254.169.254/latest/meta-data/", "http://10.0.0.1/", "http://[fd00:ec2::254]/",
    "http://[::ffff:a9fe:a9fe]/", "http://2852039166/",
])  # fmt: skip
async def test_allowed_loopback_works_and_its_redirects_are_checked_before_connecting(
    server: tuple[int, list[str]], transport_log: list[str], monkeypatch: pytest.MonkeyPatch,
    target: str,
) -> None:
    port, hosts = server
    monkeypatch.setenv(HTTP_ALLOW_ENV, "127.0.0.1,localhost")
    ok = await run(Tool.http_get, url=f"http://localhost:{port}/secret")
    assert ok.ok and ok.content.endswith("loopback secret"), ok.content
    assert hosts == [f"localhost:{port}"]  # pinned to the address, Host header kept
    outcome = await run(Tool.http_get, url=f"http://127.0.0.1:{port}/to?url={target}")
    assert not outcome.ok and "refused" in outcome.content, outcome.content
    assert all(ipaddress.ip_address(h).is_loopback for h in transport_log), transport_log


async def test_redirects_are_bounded(
    server: tuple[int, list[str]], transport_log: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    port, _ = server
    monkeypatch.setenv(HTTP_ALLOW_ENV, "127.0.0.1")
    url = f"http://127.0.0.1:{port}/secret"
    for _ in range(7):
        url = str(httpx.URL(f"http://127.0.0.1:{port}/to", params={"url": url}))
    outcome = await run(Tool.http_get, url=url)
    assert not outcome.ok and "more than 5 redirects" in outcome.content
    assert len(transport_log) == 6


async def test_http_get_ignores_proxy_settings_from_the_environment(
    server: tuple[int, list[str]], transport_log: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``trust_env=False``: an HTTP_PROXY in the worker's environment (which could point the
    tool's traffic anywhere, or carry credentials) is not used."""
    port, hosts = server
    proxy = RecordingServer().start()
    try:
        for var in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
            monkeypatch.setenv(var, proxy.url)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        monkeypatch.setenv(HTTP_ALLOW_ENV, "127.0.0.1")
        outcome = await run(Tool.http_get, url=f"http://127.0.0.1:{port}/secret")
    finally:
        proxy.stop()
    assert outcome.ok and outcome.content.endswith("loopback secret"), outcome.content
    assert proxy.requests == [] and hosts == [f"127.0.0.1:{port}"]
