"""The tool pool: tools the model can call, run with coalescing, caching and rate limits.

Importing this package also attaches the built-in tools as ``Tool.read_file``,
``Tool.http_get`` and ``Tool.web_search``.
"""

from __future__ import annotations

from .builtins import (
    http_get,
    read_file,
    read_file_tool,
    set_web_search_provider,
    web_search,
)
from .cache import ResultCache, TTLCache
from .coalesce import Coalescer, InflightCoalescer, NoCoalescing
from .context import ToolContext
from .pool import ToolPool
from .ratelimit import TokenBucket
from .schema import ArgumentsInvalid, validate_arguments
from .tool import Tool, resolve_tool, tool

__all__ = [
    "ArgumentsInvalid",
    "Coalescer",
    "InflightCoalescer",
    "NoCoalescing",
    "ResultCache",
    "TTLCache",
    "TokenBucket",
    "Tool",
    "ToolContext",
    "ToolPool",
    "http_get",
    "read_file",
    "read_file_tool",
    "resolve_tool",
    "set_web_search_provider",
    "tool",
    "validate_arguments",
    "web_search",
]
