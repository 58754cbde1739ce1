"""Which modules a worker may import because a plan named them.

A plan in Redis names its tools and output schema by import path, and importing a module
runs its code. So whoever can write to Redis could make every worker import anything (``os``,
a module with side effects at import time) unless workers import only under module prefixes
their operator chose: ``AGENTBATCH_WORKER_IMPORTS=mypkg.tools,agentbatch.toolpool.builtins``.
The check runs on the path's text, before any import. The attribute is one name (a nested
class for a schema: dotted, never a dunder), so ``mytools:echo.__class__.read_file`` cannot walk
from an allowed module to a tool outside the list; the loader then checks that what it got
names itself by the same path (``owns_path``). (The embedded engine is given live objects and
imports nothing by path, so it needs no list.)
"""

from __future__ import annotations

from agentbatch.core.errors import BatchSpecError, ConfigError

__all__ = [
    "WORKER_IMPORTS_ENV", "WORKER_IMPORTS_EXAMPLE", "check_import_path", "check_not_main",
    "module_allowed", "owns_path",
    "parse_import_prefixes", "require_worker_imports",
]  # fmt: skip

WORKER_IMPORTS_ENV = "AGENTBATCH_WORKER_IMPORTS"
WORKER_IMPORTS_EXAMPLE = f"{WORKER_IMPORTS_ENV}=mypkg.tools,agentbatch.toolpool.builtins"


def _dotted(name: str) -> bool:
    return bool(name) and all(part.isidentifier() for part in name.split("."))


def parse_import_prefixes(raw: str) -> tuple[str, ...]:
    """``"a.b, c"`` → ``("a.b", "c")``; a malformed entry is a ``ConfigError``."""
    prefixes = tuple(p.strip() for p in raw.split(",") if p.strip())
    for prefix in prefixes:
        if not _dotted(prefix):
            raise ConfigError(
                f"{WORKER_IMPORTS_ENV}: {prefix!r} is not a dotted module name "
                f"(expected comma-separated module prefixes, e.g. {WORKER_IMPORTS_EXAMPLE})")
    return prefixes


def require_worker_imports(raw: str | None) -> tuple[str, ...]:
    """The allowlist a distributed worker must be given; a ``ConfigError`` says how to set it."""
    prefixes = parse_import_prefixes(raw or "")
    if not prefixes:
        raise ConfigError(
            f"{WORKER_IMPORTS_ENV} is required: the module prefixes this worker may import "
            f"tools and output schemas from (plans in Redis name them, and importing runs "
            f"code), e.g. {WORKER_IMPORTS_EXAMPLE}")
    return prefixes


def module_allowed(module: str, prefixes: tuple[str, ...]) -> bool:
    """``module`` is one of ``prefixes`` or inside one of them (``a.b`` allows ``a.b.c``)."""
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def check_import_path(path: str, prefixes: tuple[str, ...], what: str, *,
                      nested: bool = False) -> None:
    """Refuse ``path`` ("module:attr") unless its module is under ``prefixes``; no import.

    ``attr`` is one name, or with ``nested`` (a schema class inside a class) a dotted one;
    no part may be a dunder, so a path cannot reach other objects through attributes.
    """
    module, sep, attr = path.partition(":")
    if not (sep and _dotted(module) and _dotted(attr)):
        raise BatchSpecError(f"{what} {path!r}: expected an import path 'module:attr'")
    parts = attr.split(".")
    if any(part.startswith("__") for part in parts) or (len(parts) > 1 and not nested):
        raise BatchSpecError(
            f"{what} {path!r}: the attribute must be {'a class name' if nested else 'one name'}"
            " defined in the module (no attribute chains or dunder names)")
    if not module_allowed(module, prefixes):
        listed = ",".join(prefixes) if prefixes else "unset"
        raise BatchSpecError(
            f"{what} {path!r}: module {module!r} is not under {WORKER_IMPORTS_ENV} "
            f"({listed}); this worker imports tools and schemas only from the module "
            f"prefixes listed there, e.g. {WORKER_IMPORTS_EXAMPLE}")


def owns_path(obj: object, path: str) -> bool:
    """``obj`` names itself by ``path``: a Tool's ``import_path``, a class's module:qualname.

    Checked after import, so an object reached under another name (an alias, a re-export of a
    tool from a module outside the allowlist) is refused too.
    """
    own = getattr(obj, "import_path", None)
    if own is None and isinstance(obj, type):
        own = f"{obj.__module__}:{obj.__qualname__}"
    return own == path


_SCRIPT_MODULES = ("__main__", "__mp_main__")  # the script or notebook the submitter runs


def check_not_main(path: str, what: str) -> None:
    """Refuse ``path`` when it lives in the submitting script: it imports here (``__main__``
    is this process's script) but a worker's ``__main__`` is the worker, so every agent
    would fail with ``tool_import``/``schema_import`` instead of the submit."""
    module = path.partition(":")[0]
    if module in _SCRIPT_MODULES:
        name = path.partition(":")[2]
        raise BatchSpecError(
            f"{what} {name!r} is defined in the script you ran ({module}), which workers "
            f"cannot import: move it into a module on the workers' import path (e.g. "
            f"mypkg/tools.py, listed in {WORKER_IMPORTS_ENV}) and import it from there")
