"""Waits with a deadline for tests that poll what other processes write (worker counters in
Redis, a simulator's bill): every wait ends, and a failed one says what it last saw."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def poll_until(read: Callable[[], T], done: Callable[[T], bool], what: Callable[[T], str],
               timeout: float, poll_s: float = 0.2) -> T:
    """``read()`` every ``poll_s`` until ``done`` accepts its answer, which is returned;
    after ``timeout`` seconds, ``AssertionError`` with ``what`` of the last answer."""
    deadline = time.monotonic() + timeout
    while True:
        seen = read()
        if done(seen):
            return seen
        if time.monotonic() > deadline:
            raise AssertionError(what(seen))
        time.sleep(poll_s)


def wait_until(predicate: Callable[[], bool], what: str, timeout: float,
               poll_s: float = 0.2) -> None:
    """Poll ``predicate`` until true; ``AssertionError`` naming ``what`` after ``timeout``."""
    poll_until(predicate, bool, lambda _: f"gave up waiting for {what}", timeout, poll_s)
