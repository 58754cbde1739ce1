"""A tool module that records, at import time, which process imported it.

Workers in tests/integration/test_worker_imports.py are not allowed to import it; when
``TEST_IMPORT_MARKER_KEY`` is set (only in those workers' environment), importing this module
RPUSHes the importing process's pid to that Redis key, so a test can prove it was never
imported.
"""

from __future__ import annotations

import os

import redis
from pydantic import BaseModel

from agentbatch import tool

_KEY = os.environ.get("TEST_IMPORT_MARKER_KEY")
if _KEY:
    from tests.support.tools import counting_redis_url

    _client = redis.from_url(counting_redis_url())
    _client.rpush(_KEY, os.getpid())
    _client.close()


@tool
def marked(key: str) -> str:
    """A harmless tool, so a plan naming this module is otherwise valid.

    Args:
        key: anything.
    """
    return f"marked-{key}"


class MarkedAnswer(BaseModel):
    """An output schema in this module (for the schema_import case)."""

    summary: str
