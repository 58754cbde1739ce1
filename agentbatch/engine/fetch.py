"""Fetch one pinned sdist from pip's configured package index, verified before anything uses it.

``pip download`` of an sdist prepares its metadata, which runs the package's build hooks
(``setup.py``, in an environment of build requirements pip installs unpinned) before any hash
of ours is checked: a tampered file on an index ran its code first. So the engine's sdist is
fetched as plain bytes instead: the index pages pip is configured with (``index-url``, then
each ``extra-index-url``; PEP 503 HTML, as PyPI serves it) name the file, it is streamed to
disk while its sha256 is computed, and only a file whose digest equals the pin is returned.
Nothing in it runs, and no build requirement is installed: the build uses the system's cmake
and compiler only.
"""

from __future__ import annotations

import hashlib
import html
import re
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urldefrag, urljoin, urlsplit

__all__ = ["DEFAULT_INDEX", "FetchError", "fetch_pinned", "pip_settings", "project_files"]

DEFAULT_INDEX = "https://pypi.org/simple"
PIP_CONFIG_TIMEOUT_S = 120.0
HTTP_TIMEOUT_S = 180.0  # per read, as pip's default-timeout here
MAX_BYTES = 512 << 20  # far above the ~37 MB sdist: a runaway response is cut off
_ANCHOR = re.compile(r"<a\s[^>]*?href\s*=\s*[\"']([^\"']+)[\"'][^>]*>(.*?)</a>", re.I | re.S)
_SETTING = re.compile(r"^(?P<key>[^=]+)=(?P<q>['\"]?)(?P<value>.*)(?P=q)$")


class FetchError(RuntimeError):
    """The pinned file could not be found, fetched or verified; the message says which."""


def canonical(name: str) -> str:
    """PEP 503's normalized project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pip_settings() -> tuple[list[str], str | None]:
    """(index URLs in pip's order, the CA bundle pip uses) from ``pip config list``, so the
    file comes from where ``pip install`` would take it (an environment variable wins)."""
    cmd = [sys.executable, "-m", "pip", "config", "list"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_CONFIG_TIMEOUT_S,
                              check=False)
    except subprocess.TimeoutExpired:
        raise FetchError(f"`{' '.join(cmd)}` took over {PIP_CONFIG_TIMEOUT_S:.0f}s") from None
    found: dict[str, str] = {}
    for line in proc.stdout.splitlines():  # in pip's override order: the last one wins
        match = _SETTING.match(line.strip())
        if match:
            found[match["key"].rpartition(".")[2]] = match["value"]
    indexes = [found.get("index-url") or DEFAULT_INDEX, *found.get("extra-index-url", "").split()]
    return [i for i in indexes if i], found.get("cert")


def _open(url: str, cafile: str | None) -> Any:
    """``urlopen`` with pip's CA bundle for https (a response usable as a context manager)."""
    context = ssl.create_default_context(cafile=cafile) if url.startswith("https:") else None
    request = urllib.request.Request(url, headers={"Accept": "text/html"})
    return urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S, context=context)


def project_files(index: str, project: str, cafile: str | None = None) -> list[tuple[str, str]]:
    """(file name, URL) of every file the index's PEP 503 page for ``project`` lists; []
    when the index does not have the project."""
    page = f"{index.rstrip('/')}/{canonical(project)}/"
    if urlsplit(page).scheme == "file":
        page += "index.html"  # a directory index on disk, as pip reads one
    try:
        with _open(page, cafile) as response:
            text = response.read(16 << 20).decode("utf-8", errors="replace")
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return []
        raise FetchError(f"{page}: HTTP {exc.code} {exc.reason}") from None
    except FileNotFoundError:
        return []
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, FileNotFoundError | NotADirectoryError):
            return []
        raise FetchError(f"cannot read the package index page {page}: {reason}") from None
    files = []
    for href, text_ in _ANCHOR.findall(text):
        url = urldefrag(urljoin(page, html.unescape(href)))[0]
        name = html.unescape(re.sub(r"<[^>]+>", "", text_)).strip()
        files.append((name or url.rsplit("/", 1)[-1], url))
    return files


def _download(url: str, dest: Path, cafile: str | None) -> str:
    """Stream ``url`` into ``dest``; its sha256 hex digest."""
    digest = hashlib.sha256()
    size = 0
    try:
        with _open(url, cafile) as response, open(dest, "wb") as out:
            while chunk := response.read(1 << 20):
                size += len(chunk)
                if size > MAX_BYTES:
                    raise FetchError(f"{url} is larger than {MAX_BYTES >> 20} MB; refused")
                digest.update(chunk)
                out.write(chunk)
    except (urllib.error.URLError, OSError) as exc:
        raise FetchError(f"cannot download {url}: {getattr(exc, 'reason', exc)}") from None
    return digest.hexdigest()


def fetch_pinned(project: str, wanted: Callable[[str], bool], sha256: str, dest: Path, *,
                 log: Callable[[str], None] = lambda _: None) -> Path:
    """The file of ``project`` whose name ``wanted`` accepts and whose sha256 is ``sha256``,
    downloaded into the directory ``dest``. A file with another digest is deleted unread and
    the next index is tried; none found or none matching is a ``FetchError``."""
    indexes, cafile = pip_settings()
    refused: list[str] = []
    for index in indexes:
        for name, url in project_files(index, project, cafile):
            if not wanted(name) or "/" in name or name.startswith("."):
                continue
            target = dest / name
            got = _download(url, target, cafile)
            if got == sha256:
                return target
            target.unlink()
            refused.append(f"{url}: sha256 {got}")
            log(f"refused {url}: sha256 {got} is not the pinned {sha256}")
    if refused:
        raise FetchError(f"{project}: no file with the pinned sha256 {sha256}; refusing to use "
                         f"{'; '.join(refused)}")
    raise FetchError(f"{project}: the pinned file is on none of pip's indexes "
                     f"({', '.join(indexes)}); check `pip config list` (index-url)")
