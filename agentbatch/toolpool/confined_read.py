"""Reading a file the model named, without ever leaving one root directory.

The path is walked one component at a time from an open descriptor of the root
(``openat`` with ``O_NOFOLLOW``), so there is no window between checking a path and opening
it: a component swapped for a symlink after it was looked at makes the open fail instead of
leading outside. Symlinks inside the root are resolved here, by hand, beneath the root.
``/proc``, ``/sys`` and ``/dev`` (and any file system of those kinds mounted elsewhere) are
refused even when the root contains them, since they expose the worker's environment and
devices.

Not detected: a hard link inside the root to a file outside it (a hard link *is* the file;
only the root's owner can create one, so keep the root free of links you did not make).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path, PurePosixPath

from agentbatch.core.errors import ToolError

__all__ = ["DENIED_TREES", "read_confined"]

DENIED_TREES = ("/proc", "/sys", "/dev")
_MAX_SYMLINKS = 40  # as the kernel's own limit
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY


def _outside(path: str) -> ToolError:
    return ToolError(
        f"read_file refused {path!r}: it is outside the allowed root directory "
        "(use a path relative to the root; '..' and symlinks may not leave it)"
    )


def _denied(path: str) -> ToolError:
    return ToolError(f"read_file refused {path!r}: /proc, /sys and /dev are never readable")


def _in_denied_tree(parts: list[str]) -> bool:
    real = "/" + "/".join(parts)
    return any(real == d or real.startswith(d + "/") for d in DENIED_TREES)


def _denied_devices() -> set[int]:
    """st_dev of /proc, /sys, /dev when they are their own mounts (to catch bind mounts)."""
    try:
        root_dev = os.stat("/").st_dev
    except OSError:
        return set()
    devices = set()
    for tree in DENIED_TREES:
        try:
            dev = os.stat(tree).st_dev
        except OSError:
            continue
        if dev != root_dev:
            devices.add(dev)
    return devices


def _relative_parts(roots: tuple[PurePosixPath, ...], target: str) -> list[str] | None:
    """``target``'s components below the root, or None when an absolute target is outside."""
    p = PurePosixPath(target)
    if not p.is_absolute():
        return list(p.parts)
    for root in roots:
        if p == root or root in p.parents:
            return list(p.relative_to(root).parts)
    return None


class _Walk:
    """A stack of open directory descriptors from the root down to the current directory."""

    def __init__(self, root_fd: int, root_parts: list[str], path: str) -> None:
        self.fds = [root_fd]
        self.names: list[str] = []
        self.root_parts = root_parts
        self.path = path
        self.bad_devices = _denied_devices()

    @property
    def fd(self) -> int:
        return self.fds[-1]

    def real_parts(self, name: str | None = None) -> list[str]:
        return self.root_parts + self.names + ([name] if name else [])

    def up(self) -> None:
        if not self.names:
            raise _outside(self.path)
        self.names.pop()
        os.close(self.fds.pop())

    def reset(self) -> None:
        while self.names:
            self.up()

    def down(self, name: str) -> None:
        if _in_denied_tree(self.real_parts(name)):
            raise _denied(self.path)
        fd = os.open(name, _DIR_FLAGS, dir_fd=self.fd)
        self.fds.append(fd)
        self.names.append(name)
        if os.fstat(fd).st_dev in self.bad_devices:
            raise _denied(self.path)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


def _open_beneath(root_dir: Path, roots: tuple[PurePosixPath, ...], path: str) -> int:
    """An fd of the regular file ``path`` names beneath ``root_dir`` (symlinks resolved here)."""
    parts = _relative_parts(roots, path)
    if parts is None:
        raise _outside(path)
    root_parts = list(PurePosixPath(root_dir).parts[1:])
    if _in_denied_tree(root_parts):
        raise _denied(path)
    walk = _Walk(os.open(root_dir, _DIR_FLAGS), root_parts, path)
    try:
        if os.fstat(walk.fd).st_dev in walk.bad_devices:
            raise _denied(path)
        pending = list(reversed(parts))  # a stack: the next component is last
        links = 0
        while pending:
            name = pending.pop()
            if name in ("", "."):
                continue
            if name == "..":
                walk.up()
                continue
            st = os.stat(name, dir_fd=walk.fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                links += 1
                if links > _MAX_SYMLINKS:
                    raise ToolError(f"read_file: too many symlinks in {path!r}")
                target = os.readlink(name, dir_fd=walk.fd)
                below = _relative_parts(roots, target)
                if below is None:
                    raise _outside(path)
                if PurePosixPath(target).is_absolute():
                    walk.reset()
                pending.extend(reversed(below))
                continue
            if pending:
                walk.down(name)
                continue
            if _in_denied_tree(walk.real_parts(name)):
                raise _denied(path)
            if stat.S_ISDIR(st.st_mode):
                raise ToolError(f"read_file: {path!r} is a directory, not a file")
            if not stat.S_ISREG(st.st_mode):
                raise ToolError(f"read_file: {path!r} is not a regular file")
            fd = os.open(name, _FILE_FLAGS, dir_fd=walk.fd)
            # Checked again on what was actually opened (it may have been swapped meanwhile).
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_dev in walk.bad_devices:
                os.close(fd)
                raise ToolError(f"read_file: {path!r} is not a regular file")
            return fd
        raise ToolError(f"read_file: {path!r} is a directory, not a file")
    finally:
        walk.close()


def read_confined(root: str | Path, path: str, max_bytes: int = 200_000) -> str:
    """Read ``path`` (relative to ``root``, or absolute inside it) without leaving ``root``."""
    if not path or "\x00" in path:
        raise ToolError("read_file needs a non-empty file path")
    root_dir = Path(root).resolve()
    roots = (PurePosixPath(root_dir), PurePosixPath(os.path.abspath(root)))
    try:
        fd = _open_beneath(root_dir, roots, path)
    except ToolError:
        raise
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise ToolError(f"read_file: no such file: {path!r}") from None
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise ToolError(f"read_file cannot open {path!r}: it changed while being read, "
                            "or a path component is not a directory") from None
        raise ToolError(f"read_file cannot read {path!r}: {exc.strerror or exc}") from None
    max_bytes = max(1, int(max_bytes))
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(max_bytes + 1)
        except OSError as exc:
            raise ToolError(f"read_file cannot read {path!r}: {exc.strerror or exc}") from None
        size = os.fstat(f.fileno()).st_size
    text = data[:max_bytes].decode("utf-8", errors="replace")
    if len(data) > max_bytes:
        text += f"\n[truncated: showing the first {max_bytes} of {size} bytes]"
    return text
