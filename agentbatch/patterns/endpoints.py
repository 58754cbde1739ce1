"""The endpoint pool a pattern runs over: one URL, a list of URLs, or ``@hostfile`` entries.

Every pattern resolves its ``backend=`` here, before anything is sent, so an empty pool (an
empty list, a hostfile listing nothing) is a clear error naming the parameter instead of a
silent fall-back to ``AGENTBATCH_BACKEND`` or a batch with nowhere to go.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from agentbatch.backends.registry import backend_from_url
from agentbatch.backends.setup import expand_backend_urls
from agentbatch.core.errors import BatchSpecError


def endpoint_urls(backend: str | Sequence[str] | None, *, who: str) -> list[str]:
    """The pool's URLs, hostfiles expanded. ``None`` reads ``AGENTBATCH_BACKEND``."""
    if backend is None:
        backend = os.environ.get("AGENTBATCH_BACKEND") or None
        if backend is None:
            raise BatchSpecError(
                f"{who}: backend is required: a URL, a list of URLs or '@hostfile' "
                "(or set AGENTBATCH_BACKEND)")
    given: list[Any] = [backend] if isinstance(backend, str) else list(backend)
    for i, url in enumerate(given):
        if not isinstance(url, str) or not url.strip():
            raise BatchSpecError(f"{who}: backend[{i}] must be a non-empty URL string, "
                                 f"got {url!r}")
    urls = expand_backend_urls([u.strip() for u in given])
    if not urls:
        raise BatchSpecError(
            f"{who}: backend= is an empty pool: give at least one endpoint URL "
            "(a URL, a list of URLs or '@hostfile'); nothing was sent")
    return urls


def pool_can_batch(urls: list[str]) -> bool:
    """True when every endpoint takes a list of prompts on ``/v1/completions`` (the drivers
    connect lazily, so building one to read its capabilities sends nothing)."""
    return all(backend_from_url(u).capabilities.batch_prompting for u in urls)


def check_prompts(prompts: Any, *, who: str, name: str = "prompts") -> list[str]:
    """``prompts`` as a list of strings; a bare string (a common slip) is refused."""
    if isinstance(prompts, str) or not isinstance(prompts, Sequence):
        raise BatchSpecError(f"{who}: {name} must be a list of strings, "
                             f"got {type(prompts).__name__}")
    out = list(prompts)
    for i, p in enumerate(out):
        if not isinstance(p, str):
            raise BatchSpecError(f"{who}: {name}[{i}] must be a string, got {type(p).__name__}")
    return out
