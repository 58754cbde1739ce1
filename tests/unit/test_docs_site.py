"""The README stays short and its set-up commands stay the ones CI runs; the docs site's nav and
the README's links point at files that exist (``mkdocs build --strict`` in .ci/run checks the
links inside docs/)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DEMO_COMMAND = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && agentbatch demo")
MAX_README_LINES = 320


def _ci_test_command() -> str:
    """The line under .ci/run's "The README's test command" comment."""
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    marks = [i for i, line in enumerate(lines) if line.startswith("# The README's test command")]
    assert len(marks) == 1, ".ci/run must mark the README's test command once"
    return lines[marks[0] + 1].strip()


def _bash_lines(text: str) -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    return [line.strip() for block in blocks for line in block.splitlines()]


def test_readme_is_at_most_about_300_lines():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; move reference text to docs/"


def test_readme_shows_the_demo_command_and_the_test_command_ci_runs():
    bash = _bash_lines(README.read_text())
    assert DEMO_COMMAND in bash
    ci = _ci_test_command()
    assert ci.startswith("python -m pip install") and "pytest" in ci
    # The README's line only prepends the system packages and the venv to what CI runs.
    assert any(line.endswith(ci) for line in bash), f"no README bash line ends with {ci!r}"


def test_readme_links_point_at_files_that_exist():
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    local = [t for t in targets if "://" not in t]
    assert "docs/img/peers.png" in local and "docs/results.md" in local
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, f"README links to missing files: {missing}"


def _nav_pages(nav: list) -> list[str]:
    pages = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_mkdocs_nav_lists_existing_pages_and_the_docs_extra_has_the_tools():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages = _nav_pages(config["nav"])
    assert "index.md" in pages and "results.md" in pages
    assert [p for p in pages if not (ROOT / "docs" / p).exists()] == []
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    docs = " ".join(project["optional-dependencies"]["docs"])
    assert "mkdocs" in docs and "matplotlib" in docs
    assert not any(d.startswith("matplotlib") for d in project["dependencies"])
