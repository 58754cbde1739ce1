"""What a result file records about where it was measured, and small shared helpers."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent / "results"
PACKAGES = ("agentbatch", "batch-agent", "aiohttp", "httpx", "pydantic")

T = TypeVar("T")


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_revision() -> dict[str, Any]:
    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                                  timeout=10, check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain", "--", "agentbatch")
    diff = git("diff", "HEAD", "--", "agentbatch") or ""
    return {
        "commit": git("rev-parse", "HEAD"),
        "agentbatch_dirty": bool(status),
        # identifies uncommitted agentbatch changes the numbers were measured with
        "agentbatch_diff_sha1": hashlib.sha1(diff.encode()).hexdigest()[:12] if diff else None,
    }


def agentbatch_http_client() -> str:
    """The HTTP library agentbatch's OpenAI-compatible backend uses by default."""
    try:
        from agentbatch.backends.openai_compat import OpenAICompatBackend

        session = OpenAICompatBackend("http://127.0.0.1:9")._session
    except Exception as exc:  # report, never fail a benchmark over this
        return f"unknown ({exc})"
    return "aiohttp" if type(session).__name__ == "AiohttpSession" else "httpx"


def machine_info() -> dict[str, Any]:
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count()
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "loadavg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "implementation": platform.python_implementation(),
        "packages": package_versions(),
        "agentbatch_http_client": agentbatch_http_client(),
        "git": git_revision(),
    }


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def sim_get(url: str, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + path, timeout=10) as resp:
        return json.loads(resp.read())


def sim_reset(url: str) -> None:
    req = urllib.request.Request(url + "/sim/reset", data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=10) as resp:
        resp.read()


def median(values: list[float | int | None]) -> float | None:
    """The median, kept an int when the inputs are ints and the median is whole."""
    clean = [v for v in values if v is not None]
    if not clean:
        return None
    mid = statistics.median(clean)
    if all(isinstance(v, int) for v in clean) and float(mid).is_integer():
        return int(mid)
    return mid


def rotated(items: Sequence[T], by: int) -> list[T]:
    """``items`` starting ``by`` places later (round ``by`` of an interleaved benchmark:
    A B C, B C A, C A B, ...), so no system holds the same place in every round."""
    k = by % len(items) if items else 0
    return [*items[k:], *items[:k]]


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def write_json(path: str | Path, data: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
    return path


class Stopwatch:
    """Wall and process-CPU time of a block (CPU counts every thread of this process)."""

    def __enter__(self) -> Stopwatch:
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_s = time.perf_counter() - self.wall0
        self.cpu_s = time.process_time() - self.cpu0
