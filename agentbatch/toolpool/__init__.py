"""The tool pool: tools the model can call, run with coalescing, caching and rate limits.

Importing this package also attaches the built-in tools as ``Tool.read_file``,
``Tool.http_get`` and ``Tool.web_search``.
"""

from __future__ import annotations

from agentbatch.core.tool import Tool, resolve_tool, tool
from agentbatch.core.tool_context import ToolContext
from agentbatch.core.tool_schema import ArgumentsInvalid, validate_arguments
from agentbatch.toolpool.builtins import (
    http_get,
    read_file,
    read_file_tool,
    set_web_search_provider,
    web_search,
)
from agentbatch.toolpool.cache import ResultCache, TTLCache
from agentbatch.toolpool.coalesce import Coalescer, InflightCoalescer, NoCoalescing
from agentbatch.toolpool.pool import ToolPool
from agentbatch.toolpool.ratelimit import TokenBucket

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
