"""One temp directory per test process for what the support classes write (worker and redis
logs, data dirs, rendered ACL files holding passwords), removed when the process exits.

A failed pytest session keeps it (``keep()``, called from conftest's session-finish hook) and
says where, so a failing test's logs can still be read.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

_root: Path | None = None
_keep = False


def root() -> Path:
    """This process's scratch directory, created on first use."""
    global _root
    if _root is None:
        _root = Path(tempfile.mkdtemp(prefix=f"agentbatch-tests-{os.getpid()}-"))
        atexit.register(remove)
    return _root


def scratch_dir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix, dir=root()))


def scratch_file(prefix: str, suffix: str = "") -> Path:
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=root())
    os.close(fd)
    return Path(path)


def keep() -> Path | None:
    """Leave the directory in place at exit (a failed session); returns it, if any."""
    global _keep
    _keep = True
    return _root


def remove() -> None:
    if _root is not None and not _keep:
        shutil.rmtree(_root, ignore_errors=True)
