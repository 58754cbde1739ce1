"""Built-in tools: ``read_file``, ``http_get``, ``web_search`` (also ``Tool.read_file`` etc.).

Each is a module-level ``@tool``, so worker processes re-import it from
``agentbatch.toolpool.builtins:<name>``. There is deliberately no code-evaluation tool.
``read_file`` is confined to one root directory because the model chooses the path: the
root must be configured (``AGENTBATCH_FILE_ROOT``), /proc, /sys and /dev are never readable,
and hard links inside the root are not detected (see ``confined_read``). ``http_get``
reaches only public addresses unless the operator allows more (see ``public_http``).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import httpx
from pydantic import Field

from agentbatch.core.errors import ToolError
from agentbatch.core.tool import Tool, is_async_callable, tool
from agentbatch.core.wait_for import wait_for
from agentbatch.toolpool.confined_read import read_confined
from agentbatch.toolpool.pool import to_text
from agentbatch.toolpool.public_http import (
    HTTP_ALLOW_ENV,
    fetch_public,
    http_allowlist,
    public_client,
)

__all__ = [
    "FILE_ROOT_ENV", "HTTP_ALLOW_ENV", "WEB_SEARCH_PROVIDER_ENV", "http_get", "read_file",
    "read_file_tool", "set_web_search_provider", "web_search",
]  # fmt: skip

FILE_ROOT_ENV = "AGENTBATCH_FILE_ROOT"
WEB_SEARCH_PROVIDER_ENV = "AGENTBATCH_WEB_SEARCH_PROVIDER"
HTTP_TIMEOUT = 20.0
_NO_ROOT = (
    "read_file has no root directory configured: set AGENTBATCH_FILE_ROOT=/path/to/files "
    "in the environment of the process that runs tools (every worker), or pass "
    "agentbatch.toolpool.read_file_tool(root) as the tool (embedded engine only)"
)
_NO_PROVIDER = (
    "web_search has no provider configured: set AGENTBATCH_WEB_SEARCH_PROVIDER=module:function "
    "or call agentbatch.toolpool.set_web_search_provider(fn)"
)

# Hard caps, so a model asking for max_bytes=10**12 cannot exhaust a worker's memory.
_ReadBytes = Annotated[int, Field(ge=1, le=5_000_000)]
_HttpBytes = Annotated[int, Field(ge=1, le=5_000_000)]
_Results = Annotated[int, Field(ge=1, le=50)]

# -- read_file -----------------------------------------------------------------------------


@tool(cacheable=True)
def read_file(path: str, max_bytes: _ReadBytes = 200_000) -> str:
    """Read a text file under the allowed root directory.

    Args:
        path: Path of the file, relative to the root directory (an absolute path must lie
            inside the root).
        max_bytes: Read at most this many bytes; a longer file is truncated with a note.
    """
    # No default root: a worker's working directory is often "/" (systemd), which would
    # hand the model every file the worker can read.
    root = os.environ.get(FILE_ROOT_ENV, "").strip()
    if not root:
        raise ToolError(_NO_ROOT)
    return read_confined(root, path, max_bytes)


def read_file_tool(root: str | Path) -> Tool:
    """A ``read_file`` tool confined to ``root`` (not re-importable: its import_path is None)."""
    root_dir = Path(root).resolve()

    def confined_read_file(path: str, max_bytes: _ReadBytes = 200_000) -> str:
        return read_confined(root_dir, path, max_bytes)

    confined_read_file.__doc__ = read_file.fn.__doc__  # same schema as the default read_file
    return tool(name="read_file", cacheable=True)(confined_read_file)


# -- http_get ------------------------------------------------------------------------------


@tool
async def http_get(url: str, max_bytes: _HttpBytes = 100_000) -> str:
    """Fetch a URL with HTTP GET; returns the status line, then the body as text.

    Args:
        url: An http:// or https:// URL of a public host.
        max_bytes: Return at most this many bytes of the body; a longer body is truncated.
    """
    try:
        parsed = httpx.URL(url)
    except Exception as exc:
        raise ToolError(f"http_get: invalid URL {url!r}: {exc}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ToolError(f"http_get: only http:// and https:// URLs are supported, got {url!r}")
    try:
        return await wait_for(_fetch(parsed, max(1, int(max_bytes))), HTTP_TIMEOUT)
    except asyncio.TimeoutError:
        raise ToolError(f"http_get: {url!r} timed out after {HTTP_TIMEOUT:g}s") from None
    except httpx.HTTPError as exc:
        raise ToolError(
            f"http_get: request to {url!r} failed: {type(exc).__name__}: {exc}"
        ) from None


async def _fetch(url: httpx.URL, max_bytes: int) -> str:
    body = bytearray()
    client = public_client(HTTP_TIMEOUT)
    async with client:
        response, _ = await fetch_public(client, url, http_allowlist())
        try:
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > max_bytes:
                    break
        finally:
            await response.aclose()
        status = f"HTTP {response.status_code} {response.reason_phrase}".rstrip()
        content_type = response.headers.get("content-type", "")
        encoding = response.charset_encoding or "utf-8"
    try:
        text = bytes(body[:max_bytes]).decode(encoding, errors="replace")
    except LookupError:  # a charset Python does not know
        text = bytes(body[:max_bytes]).decode("utf-8", errors="replace")
    if len(body) > max_bytes:
        text += f"\n[truncated after {max_bytes} bytes]"
    header = f"{status}\ncontent-type: {content_type}" if content_type else status
    return f"{header}\n\n{text}"


# -- web_search ----------------------------------------------------------------------------

_provider: Callable[[str, int], Any] | None = None


def set_web_search_provider(fn: Callable[[str, int], Any] | None) -> None:
    """Use ``fn(query, max_results) -> list[dict] | str`` (sync or async); None unsets it."""
    global _provider
    if fn is not None and not callable(fn):
        raise TypeError("the web search provider must be callable")
    _provider = fn


def _load_provider() -> Callable[[str, int], Any] | None:
    if _provider is not None:
        return _provider
    spec = os.environ.get(WEB_SEARCH_PROVIDER_ENV, "").strip()
    if not spec:
        return None
    module_name, sep, attr = spec.partition(":")
    if not (sep and module_name and attr):
        raise ToolError(f"web_search: {WEB_SEARCH_PROVIDER_ENV}={spec!r} is not 'module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as exc:
        raise ToolError(
            f"web_search: cannot load provider {spec!r}: {type(exc).__name__}: {exc}"
        ) from None
    if not callable(obj):
        raise ToolError(f"web_search: provider {spec!r} is not callable")
    return obj


@tool(cacheable=True)
async def web_search(query: str, max_results: _Results = 5) -> str:
    """Search the web; returns the top results (typically title, url and snippet).

    Args:
        query: What to search for.
        max_results: How many results to return.
    """
    provider = _load_provider()
    if provider is None:
        raise ToolError(_NO_PROVIDER)
    if is_async_callable(provider):
        result = await provider(query, max_results)
    else:
        result = await asyncio.to_thread(provider, query, max_results)
        if inspect.isawaitable(result):
            result = await result
    if isinstance(result, str):
        return result
    if isinstance(result, (list, tuple)):
        return to_text(list(result)[:max_results])
    raise ToolError(
        f"web_search: the provider returned {type(result).__name__}, "
        "expected a list of dicts or a string"
    )


Tool.read_file = read_file
Tool.http_get = http_get
Tool.web_search = web_search
