"""``Tool``: a function the model may call, with its schema and execution policy.

A ``Tool`` is plain data plus a callable, so it can be shared by every agent of a batch. For
distributed runs a worker process cannot receive the function itself, so each Tool carries an
``import_path`` ("module:attr") from which the worker re-imports the very same object.
"""

from __future__ import annotations

import copy
import difflib
import functools
import hashlib
import importlib
import inspect
import math
import re
import sys
import textwrap
import types
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Literal, overload

from agentbatch.core.errors import BatchSpecError, ToolError
from agentbatch.core.tool_context import ToolContext
from agentbatch.core.tool_output_cap import check_limit
from agentbatch.core.tool_schema import ArgSpec, build_arg_spec

__all__ = ["Tool", "ToolContext", "is_async_callable", "resolve_tool", "tool"]

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # what the OpenAI and Anthropic APIs accept
_SHARES = ("batch", "fleet")

Share = Literal["batch", "fleet"]


def _doc(text: str) -> dict[str, str]:
    """A field's docstring, where ``help(tool)`` reads it."""
    return {"doc": text}


@dataclass(frozen=True)
class Tool:
    """A callable the model can invoke.

    Built by ``@tool`` (which derives ``parameters`` and ``description`` from the signature and
    docstring) or directly, in which case missing ``parameters``/``description`` are derived the
    same way. Arguments are always validated against the function's signature.

    Sharing: only tools declared safe to share merge calls from different agents
    (``cacheable=True``, or ``coalesce=True`` for read-only tools whose results must not be
    cached); every other call runs once per agent call. ``share`` is how far sharing reaches:
    one batch (default) or the whole fleet. ``identity`` (import path + version) names the
    tool in cache and coalescing keys, never its model-facing name.
    """

    name: str
    fn: Callable[..., Any]
    description: str = field(default="", metadata=_doc(
        "what the model reads about the tool (default: the function's docstring)."))
    parameters: dict[str, Any] | None = field(default=None, compare=False)  # JSON schema, object
    cacheable: bool = field(default=False, metadata=_doc(
        "the result depends only on the arguments: results are cached and identical calls "
        "merged."))
    rate_limit: float | None = field(default=None, metadata=_doc(
        "max executions per second (token bucket, burst 1): per process on the embedded "
        "engine, fleet-wide (one bucket in Redis, distributed/tool_rate.py) on the distributed "
        "one."))
    timeout: float | None = field(default=None, metadata=_doc("seconds per execution."))
    import_path: str | None = None  # "module:attr" a worker process re-imports this Tool from
    spec: ArgSpec = field(default=None, repr=False, compare=False)  # type: ignore[assignment]
    version: str | None = field(default=None, metadata=_doc(
        "changes the tool's identity; None: a hash of its signature and source."))
    coalesce: bool = field(default=False, metadata=_doc(
        "read-only: identical concurrent calls share one execution, without caching."))
    share: Share = field(default="batch", metadata=_doc(
        'how far cache and coalescing reach: one batch, or the whole fleet ("fleet").'))
    lock_ttl: float | None = field(default=None, metadata=_doc(
        "seconds a worker that stops renewing keeps a call before another may take it over; "
        "None: the pool's default."))
    max_output_chars: int | None = field(default=None, metadata=_doc(
        "chars of output kept (the rest cut, with a marker); None: the batch's "
        "max_tool_output_chars."))
    cache_key: Callable[..., Any] | None = field(default=None, compare=False, metadata=_doc(
        "called with a call's arguments as the function gets them; its return value (JSON) "
        "is the key calls share a cached result and an execution by, instead of the exact "
        "arguments (e.g. a normalised path). Needs cacheable or coalesce; part of the "
        "tool's identity."))
    identity: str = field(init=False, default="", compare=False)  # "path@version"

    # Built-in tools, attached by ``agentbatch.toolpool.builtins`` (avoids a circular import).
    read_file: ClassVar[Tool]
    http_get: ClassVar[Tool]
    web_search: ClassVar[Tool]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise BatchSpecError(
                f"tool name {self.name!r} must be 1-64 characters of letters, digits, '_' or '-'"
            )
        if not callable(self.fn):
            raise BatchSpecError(f"tool {self.name!r}: fn is not callable")
        if self.share not in _SHARES:
            raise BatchSpecError(
                f"tool {self.name!r}: share must be 'batch' or 'fleet', not {self.share!r}"
            )
        if self.share == "fleet" and not self.shares_calls:
            raise BatchSpecError(
                f"tool {self.name!r}: share='fleet' needs cacheable=True or coalesce=True "
                "(a tool with side effects never shares calls)"
            )
        if self.version is not None and (not isinstance(self.version, str) or not self.version):
            raise BatchSpecError(f"tool {self.name!r}: version must be a non-empty string")
        limits = (("rate_limit", self.rate_limit), ("timeout", self.timeout),
                  ("lock_ttl", self.lock_ttl))
        for label, value in limits:
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise BatchSpecError(f"tool {self.name!r}: {label} must be a positive number")
        if self.max_output_chars is not None:
            check_limit(self.max_output_chars, f"tool {self.name!r}: max_output_chars")
        spec = self.spec if self.spec is not None else build_arg_spec(self.fn, name=self.name)
        object.__setattr__(self, "spec", spec)
        if self.parameters is None:
            object.__setattr__(self, "parameters", copy.deepcopy(spec.schema))
        elif not isinstance(self.parameters, dict) or self.parameters.get("type") != "object":
            raise BatchSpecError(f"tool {self.name!r}: parameters must be an object JSON schema")
        if not self.description:
            object.__setattr__(self, "description", spec.description)
        version = self.version or _code_version(self.fn)
        if self.cache_key is not None:
            self._check_cache_key(spec)
            version += f"+key:{_identity_path(self.cache_key)}@{_code_version(self.cache_key)}"
        object.__setattr__(self, "identity", f"{self.import_path or _identity_path(self.fn)}"
                                             f"@{version}")
        object.__setattr__(self, "__wrapped__", self.fn)  # inspect.signature(tool) shows fn's
        object.__setattr__(self, "__doc__", getattr(self.fn, "__doc__", None))

    def _check_cache_key(self, spec: ArgSpec) -> None:
        """``cache_key`` is a callable that takes this tool's arguments, on a sharing tool."""
        key = self.cache_key
        if not callable(key):
            raise BatchSpecError(f"tool {self.name!r}: cache_key must be a callable taking the "
                                 f"tool's arguments, got {key!r}")
        if not self.shares_calls:
            raise BatchSpecError(f"tool {self.name!r}: cache_key needs cacheable=True or "
                                 "coalesce=True (only shared calls are keyed)")
        names = list(spec.schema.get("properties") or {})
        try:
            inspect.signature(key).bind(**dict.fromkeys(names))
        except TypeError as exc:
            raise BatchSpecError(f"tool {self.name!r}: cache_key must accept the tool's "
                                 f"arguments ({', '.join(names)}): {exc}") from None
        except ValueError:  # no signature to check (some builtins): checked at call time
            pass

    def sharing_key(self, kwargs: dict[str, Any]) -> Any:
        """``cache_key`` applied to a call's arguments; ``ToolError`` naming cache_key when
        it raises, so the call fails as data the model can read."""
        assert self.cache_key is not None
        try:
            return self.cache_key(**kwargs)
        except Exception as exc:
            raise ToolError(f"error: tool {self.name!r}: its cache_key raised "
                            f"{type(exc).__name__}: {exc}") from exc

    @property
    def shares_calls(self) -> bool:
        """Whether calls from different agents may share one execution (declared safe)."""
        return self.cacheable or self.coalesce

    @property
    def is_async(self) -> bool:
        """Whether ``fn`` is a coroutine function (else the pool runs it in a thread)."""
        return is_async_callable(self.fn)

    def openai_schema(self) -> dict[str, Any]:
        """The OpenAI function-tool entry (a fresh copy: callers may not corrupt the original)."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": copy.deepcopy(self.parameters),
            },
        }

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the function directly, so decorated functions stay usable as functions."""
        return self.fn(*args, **kwargs)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # The pydantic model in ``spec`` is built at runtime and cannot be pickled; re-import
        # by path when there is one, else rebuild from the (picklable) function.
        if self.import_path:
            return resolve_tool, (self.import_path,)
        return _rebuild, (self.name, self.fn, {
            f.name: getattr(self, f.name) for f in fields(self)
            if f.init and f.name not in ("name", "fn", "spec", "import_path")})


def _rebuild(name: str, fn: Callable[..., Any], options: dict[str, Any]) -> Tool:
    """Unpickle a Tool that has no import path (keyword arguments: field order may change)."""
    return Tool(name, fn, **options)


# What ``tool()`` builds itself; every other field of ``Tool`` is an option of ``tool()``.
_BUILT = ("name", "fn", "parameters", "import_path", "spec")


def _options() -> list[Any]:
    return [f for f in fields(Tool) if f.init and f.name not in _BUILT]


@overload
def tool(fn: Callable[..., Any], /) -> Tool: ...


@overload  # for type checkers and IDEs; defaults and docs: the fields of ``Tool``
def tool(
    fn: None = None, /, *, name: str | None = ..., description: str | None = ...,
    cacheable: bool = ..., rate_limit: float | None = ..., timeout: float | None = ...,
    version: str | None = ..., coalesce: bool = ..., share: Share = ...,
    lock_ttl: float | None = ..., max_output_chars: int | None = ...,
    cache_key: Callable[..., Any] | None = ...,
) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(fn: Callable[..., Any] | None = None, /, *, name: str | None = None,
         **options: Any) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Turn a sync or async function into a ``Tool``; use as ``@tool`` or ``@tool(...)``.

    A parameter annotated ``ToolContext`` receives the call's context and is hidden from the
    model. Without ``cacheable`` or ``coalesce``, every call runs on its own; sharing stays
    within one batch unless ``share="fleet"``.
    """
    known = [f.name for f in _options()]
    for key in options:
        if key not in known:
            close = difflib.get_close_matches(key, ["name", *known], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(f"tool() got an unexpected keyword argument {key!r}{hint}")
    if options.get("description") is None:
        options.pop("description", None)
    # The decorating scope's locals resolve string annotations of nested functions under
    # ``from __future__ import annotations`` (e.g. a model class defined in the same function).
    frame = sys._getframe(1)
    caller_locals = dict(frame.f_locals) if frame.f_locals is not frame.f_globals else None
    del frame

    def wrap(f: Callable[..., Any]) -> Tool:
        if isinstance(f, Tool):
            f = f.fn
        tool_name = name or getattr(f, "__name__", None)
        if not tool_name:
            raise BatchSpecError(f"cannot infer a tool name for {f!r}; pass name=")
        spec = build_arg_spec(f, name=tool_name, localns=caller_locals)
        return Tool(name=tool_name, fn=f, parameters=copy.deepcopy(spec.schema),
                    import_path=_import_path(f), spec=spec, **options)

    return wrap(fn) if fn is not None else wrap


def _describe_options() -> None:
    """``help(tool)``: its keyword signature and an ``Options`` section, from ``Tool``'s fields."""
    P = inspect.Parameter
    params = [P("fn", P.POSITIONAL_ONLY, default=None),
              P("name", P.KEYWORD_ONLY, default=None, annotation="str | None")]
    params += [P(f.name, P.KEYWORD_ONLY, default=f.default, annotation=f.type)
               for f in _options()]
    tool.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    docs = [("name", "the name the model calls it by (default: the function's name).")]
    docs += [(f.name, f.metadata["doc"]) for f in _options()]
    lines = [textwrap.fill(f"{n}: {d}", 92, initial_indent="    ", subsequent_indent="        ")
             for n, d in docs]
    tool.__doc__ = f"{inspect.cleandoc(tool.__doc__ or '')}\n\nOptions:\n" + "\n".join(lines)


_describe_options()


def resolve_tool(obj_or_path: Tool | str) -> Tool:
    """A Tool as given, or re-imported from "module:attr" (how worker processes get tools)."""
    if isinstance(obj_or_path, Tool):
        return obj_or_path
    if not isinstance(obj_or_path, str):
        raise BatchSpecError(f"tool {obj_or_path!r}: expected a Tool or a 'module:attr' string")
    path = obj_or_path
    module_name, sep, attr = path.partition(":")
    if not (sep and module_name and attr):
        raise BatchSpecError(f"tool {path!r}: expected an import path of the form 'module:attr'")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise BatchSpecError(
            f"tool {path!r}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}"
        ) from exc
    try:
        for part in attr.split("."):
            target = getattr(target, part)
    except AttributeError:
        raise BatchSpecError(
            f"tool {path!r}: module {module_name!r} has no attribute {attr!r}"
        ) from None
    if not isinstance(target, Tool):
        raise BatchSpecError(
            f"tool {path!r} is a {type(target).__name__}, not a Tool (decorate it with @tool)"
        )
    return target


def is_async_callable(fn: Callable[..., Any]) -> bool:
    """A coroutine function, or a callable instance whose ``__call__`` is one."""
    if inspect.iscoroutinefunction(fn):
        return True
    return not inspect.isroutine(fn) and inspect.iscoroutinefunction(type(fn).__call__)


def _import_path(fn: Callable[..., Any]) -> str | None:
    """ "module:qualname" for a module-level function (where the decorated Tool will live)."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module or not qualname or "<" in qualname or "." in qualname:
        return None
    return f"{module}:{qualname}"


def _identity_path(fn: Callable[..., Any]) -> str:
    """Where ``fn`` lives, for a Tool with no import path.

    Nested functions, lambdas and callable objects get their object id too: two closures with
    the same code may capture different state (``read_file_tool(root)``), so they are
    different tools.
    """
    path = _import_path(fn)
    if path is not None:
        return path
    target = fn if inspect.isroutine(fn) else type(fn)
    module = getattr(target, "__module__", None) or "?"
    qualname = getattr(target, "__qualname__", None) or type(fn).__qualname__
    return f"{module}:{qualname}#{id(fn):x}"


def _code_version(fn: Callable[..., Any]) -> str:
    """A short hash of the signature and source: editing the tool changes its identity."""
    target = fn if inspect.isroutine(fn) else type(fn).__call__
    try:
        signature = str(inspect.signature(target))
    except (TypeError, ValueError):
        signature = "?"
    code = getattr(inspect.unwrap(target), "__code__", None)  # getsource unwraps too
    body = _source_of(code, code.co_filename) if code is not None else _source(target)
    return hashlib.sha256(f"{signature}\n{body}".encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=256)
def _source_of(code: types.CodeType, filename: str) -> str:
    """A function's source, read once per code object: tools built by one factory share it.

    (``filename`` is in the key because equal code objects may come from different files.)
    """
    return _source(code)


def _source(target: Any) -> str:
    try:
        return inspect.getsource(target)
    except (OSError, TypeError):  # no source file (REPL, frozen): the bytecode stands in
        code = getattr(target, "__code__", target)
        if isinstance(code, types.CodeType):
            return repr((code.co_code, code.co_consts))
        return repr(target)
