"""Built-in tools: ``read_file``, ``http_get``, ``web_search`` (also ``Tool.read_file`` etc.).

Each is a module-level ``@tool``, so worker processes re-import it from
``agentbatch.toolpool.builtins:<name>``. There is deliberately no code-evaluation tool.
``read_file`` is confined to one root directory because the model chooses the path.
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

from ..errors import ToolError
from .pool import to_text
from .tool import Tool, is_async_callable, tool

__all__ = [
    "FILE_ROOT_ENV", "WEB_SEARCH_PROVIDER_ENV", "http_get", "read_file", "read_file_tool",
    "set_web_search_provider", "web_search",
]  # fmt: skip

FILE_ROOT_ENV = "AGENTBATCH_FILE_ROOT"
WEB_SEARCH_PROVIDER_ENV = "AGENTBATCH_WEB_SEARCH_PROVIDER"
HTTP_TIMEOUT = 20.0
_NO_PROVIDER = (
    "web_search has no provider configured: set AGENTBATCH_WEB_SEARCH_PROVIDER=module:function "
    "or call agentbatch.toolpool.set_web_search_provider(fn)"
)

# Hard caps, so a model asking for max_bytes=10**12 cannot exhaust a worker's memory.
_ReadBytes = Annotated[int, Field(ge=1, le=5_000_000)]
_HttpBytes = Annotated[int, Field(ge=1, le=5_000_000)]
_Results = Annotated[int, Field(ge=1, le=50)]

# -- read_file -----------------------------------------------------------------------------


def read_confined(root: str | Path, path: str, max_bytes: int = 200_000) -> str:
    """Read ``path`` if, after resolving every symlink and '..', it is still inside ``root``."""
    root_dir = Path(root).resolve()
    if not path or "\x00" in path:
        raise ToolError("read_file needs a non-empty file path")
    requested = Path(path)
    candidate = requested if requested.is_absolute() else root_dir / requested
    try:
        resolved = candidate.resolve()
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop (Python < 3.13)
        raise ToolError(f"read_file cannot resolve {path!r}: {exc}") from None
    if not resolved.is_relative_to(root_dir):
        raise ToolError(
            f"read_file refused {path!r}: it is outside the allowed root directory "
            "(use a path relative to the root; '..' and symlinks may not leave it)"
        )
    if not resolved.exists():
        raise ToolError(f"read_file: no such file: {path!r}")
    if resolved.is_dir():
        raise ToolError(f"read_file: {path!r} is a directory, not a file")
    if not resolved.is_file():
        raise ToolError(f"read_file: {path!r} is not a regular file")
    max_bytes = max(1, int(max_bytes))
    try:
        with resolved.open("rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as exc:
        raise ToolError(f"read_file cannot read {path!r}: {exc.strerror or exc}") from None
    text = data[:max_bytes].decode("utf-8", errors="replace")
    if len(data) > max_bytes:
        size = resolved.stat().st_size
        text += f"\n[truncated: showing the first {max_bytes} of {size} bytes]"
    return text


@tool(cacheable=True)
def read_file(path: str, max_bytes: _ReadBytes = 200_000) -> str:
    """Read a text file under the allowed root directory.

    Args:
        path: Path of the file, relative to the root directory (an absolute path must lie
            inside the root).
        max_bytes: Read at most this many bytes; a longer file is truncated with a note.
    """
    # The root is $AGENTBATCH_FILE_ROOT, else the working directory at call time.
    return read_confined(os.environ.get(FILE_ROOT_ENV) or os.getcwd(), path, max_bytes)


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
        url: An http:// or https:// URL.
        max_bytes: Return at most this many bytes of the body; a longer body is truncated.
    """
    try:
        parsed = httpx.URL(url)
    except Exception as exc:
        raise ToolError(f"http_get: invalid URL {url!r}: {exc}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ToolError(f"http_get: only http:// and https:// URLs are supported, got {url!r}")
    try:
        return await asyncio.wait_for(_fetch(parsed, max(1, int(max_bytes))), HTTP_TIMEOUT)
    except asyncio.TimeoutError:
        raise ToolError(f"http_get: {url!r} timed out after {HTTP_TIMEOUT:g}s") from None
    except httpx.HTTPError as exc:
        raise ToolError(
            f"http_get: request to {url!r} failed: {type(exc).__name__}: {exc}"
        ) from None


async def _fetch(url: httpx.URL, max_bytes: int) -> str:
    body = bytearray()
    client = httpx.AsyncClient(timeout=HTTP_TIMEOUT, follow_redirects=True)
    async with client, client.stream("GET", url) as response:
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > max_bytes:
                break
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
