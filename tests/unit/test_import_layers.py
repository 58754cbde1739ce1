"""The packages import one way: each layer imports only the layers below it.

A new import that points up (the core reaching into an engine, the distributed engine into the
CLI) fails here, naming the module and the import, before it becomes a cycle someone has to
untangle. Every import counts: module level, inside functions, and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "agentbatch"

# layer -> the layers it may import besides itself (docs/design-notes.md "Packages")
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "metrics": {"core"},
    "sim": {"core"},
    "backends": {"core", "metrics"},
    "engine": {"core", "backends"},
    "toolpool": {"core", "metrics"},
    "turnloop": {"core", "metrics", "backends", "toolpool"},
    "embedded": {"core", "metrics", "backends", "toolpool", "turnloop"},
    "distributed": {"core", "metrics", "backends", "toolpool", "turnloop"},
    "api": {"core", "metrics", "backends", "toolpool", "turnloop", "embedded", "distributed"},
    "patterns": {"core", "metrics", "backends", "toolpool", "turnloop", "embedded",
                 "distributed", "api"},
    "compat": {"core", "toolpool", "turnloop", "api", "patterns"},
    "cli": {"package", "core", "metrics", "sim", "backends", "engine", "toolpool", "turnloop",
            "embedded", "distributed", "api", "patterns"},
    "package": {"core", "toolpool", "turnloop", "api", "patterns"},  # agentbatch/__init__.py
}
# Imports against the grain, each with its reason.
EXCEPTIONS: dict[tuple[str, str], str] = {
    ("agentbatch.distributed.workers.tasks", "agentbatch.patterns.pipeline_chain"):
        "the pipeline task is a Celery task, so it is registered on the workers' app; "
        "its body is the pattern's (imported when the task runs)",
}


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "package"
    return parts[1]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import (the layers read absolute ones)"
            found.append(node.module or "")
        elif isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
    return [m for m in found if m == "agentbatch" or m.startswith("agentbatch.")]


MODULES = sorted(ROOT.rglob("*.py"))


def test_every_package_has_a_layer() -> None:
    layers = {layer_of(module_name(p)) for p in MODULES}
    assert layers <= set(ALLOWED), f"packages without a layer: {layers - set(ALLOWED)}"


def test_each_layer_imports_only_the_layers_below_it() -> None:
    wrong = []
    for path in MODULES:
        module = module_name(path)
        mine = layer_of(module)
        for target in imports_of(path):
            theirs = layer_of(target)
            if theirs == mine or (module, target) in EXCEPTIONS:
                continue
            if theirs not in ALLOWED[mine]:
                wrong.append(f"{module} ({mine}) imports {target} ({theirs})")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_the_core_imports_nothing_else_of_the_package() -> None:
    for path in (ROOT / "core").rglob("*.py"):
        outside = [t for t in imports_of(path) if layer_of(t) != "core"]
        assert not outside, f"{module_name(path)} imports {outside}"


@pytest.mark.parametrize("pair", sorted(EXCEPTIONS))
def test_each_exception_is_still_needed(pair: tuple[str, str]) -> None:
    """An exception whose import is gone is deleted, so the list does not grow stale."""
    module, target = pair
    path = ROOT.parent / (module.replace(".", "/") + ".py")
    assert target in imports_of(path)
