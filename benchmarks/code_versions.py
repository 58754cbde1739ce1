"""Run one benchmark step under several checkouts of agentbatch, each in its own process.

A before/after comparison in one invocation: ``--code before=/tmp/before --code after=.``
(``git worktree add /tmp/before <commit>``). The step runs as ``python <bench file> --inner
ARG`` with the checkout first on ``PYTHONPATH`` and prints one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def commit_of(path: Path) -> str | None:
    try:
        return subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def parse_codes(specs: list[str]) -> list[tuple[str, Path]]:
    """``LABEL=PATH`` options (default ``after=.``) as (label, resolved path)."""
    out = []
    for spec in specs or ["after=."]:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            raise SystemExit(f"--code: expected LABEL=PATH, got {spec!r}")
        out.append((label, Path(path).resolve()))
    return out


def run_inner(bench_file: Path, label: str, code: Path, arg: str, *,
              extra_path: Path | None = None, timeout_s: float = 900) -> dict[str, Any]:
    """The JSON row the bench's ``--inner ARG`` step printed, run on ``code``."""
    paths = [str(code)] + ([str(extra_path)] if extra_path else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    out = subprocess.run([sys.executable, str(bench_file), "--inner", arg], env=env,
                         cwd=str(extra_path or code), capture_output=True, text=True,
                         timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(f"{label} ({code}) failed:\n{out.stderr[-3000:]}")
    row = json.loads(out.stdout.strip().splitlines()[-1])
    return {"code": label, "commit": commit_of(code), **row}
