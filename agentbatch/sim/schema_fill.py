"""Deterministic JSON values that satisfy a JSON schema (pure: no IO).

The simulator answers structured-output requests with a valid instance of the schema, so the
engine's parsing and validation paths see realistic, reproducible data. Covers the subset that
Pydantic v2 ``model_json_schema()`` emits: objects, arrays, scalars with bounds, enums/consts,
``anyOf``/``oneOf``/``allOf`` and local ``$ref`` into ``$defs``.
"""

from __future__ import annotations

import copy
import hashlib
import math
import uuid
from typing import Any

# Past this depth optional parts are dropped, so recursive schemas (trees) terminate.
SOFT_DEPTH = 12
HARD_DEPTH = 64

_FORMATS = {
    "date-time": "2024-01-01T00:00:00Z",
    "date": "2024-01-01",
    "time": "00:00:00",
    "duration": "PT1S",
    "ipv4": "127.0.0.1",
    "ipv6": "::1",
    "hostname": "example.com",
}


def fill_schema(schema: dict[str, Any] | bool, agent_key: str = "") -> Any:
    """A value that validates against ``schema``; the same inputs always give the same value."""
    return _Filler(schema, agent_key).fill(schema, "value", 0)


class _Filler:
    def __init__(self, root: Any, agent_key: str) -> None:
        self.root = root
        self.tag = hashlib.sha1(agent_key.encode("utf-8")).hexdigest()[:8]
        self.small = 1 + int(self.tag, 16) % 9  # the "deterministic small int", 1..9

    def resolve(self, ref: str) -> dict[str, Any]:
        if not ref.startswith("#"):
            return {}  # remote refs are out of scope: accept anything
        node: Any = self.root
        for part in [p for p in ref[1:].split("/") if p]:
            part = part.replace("~1", "/").replace("~0", "~")
            node = node.get(part, {}) if isinstance(node, dict) else {}
        return node if isinstance(node, dict) else {}

    def fill(self, s: Any, name: str, depth: int) -> Any:
        if s is True or s == {}:
            return f"{name}-{self.tag}"
        if not isinstance(s, dict) or depth > HARD_DEPTH:
            return None
        if "const" in s:
            return copy.deepcopy(s["const"])
        if s.get("enum"):
            return copy.deepcopy(s["enum"][0])
        if "$ref" in s:
            merged = {**self.resolve(s["$ref"]), **{k: v for k, v in s.items() if k != "$ref"}}
            return self.fill(merged, name, depth + 1)
        if s.get("default") is not None:
            return copy.deepcopy(s["default"])
        for key in ("anyOf", "oneOf"):
            if s.get(key):
                return self.fill(self._choose(s[key], depth), name, depth + 1)
        if s.get("allOf"):
            return self.fill(self._merge(s), name, depth + 1)
        return self._typed(s, self._type(s), name, depth)

    def _choose(self, options: list[Any], depth: int) -> Any:
        def is_null(o: Any) -> bool:
            return isinstance(o, dict) and o.get("type") == "null"

        non_null = [o for o in options if not is_null(o)]
        if not non_null or (depth > SOFT_DEPTH and len(non_null) < len(options)):
            return {"type": "null"}
        return non_null[0]

    def _merge(self, s: dict[str, Any]) -> dict[str, Any]:
        merged: dict[str, Any] = {k: v for k, v in s.items() if k != "allOf"}
        for sub in s["allOf"]:
            if isinstance(sub, dict) and "$ref" in sub:
                sub = {**self.resolve(sub["$ref"]), **{k: v for k, v in sub.items() if k != "$ref"}}
            if not isinstance(sub, dict):
                continue
            for k, v in sub.items():
                if k == "properties":
                    merged["properties"] = {**merged.get("properties", {}), **v}
                elif k == "required":
                    merged["required"] = list(dict.fromkeys([*merged.get("required", []), *v]))
                else:
                    merged.setdefault(k, v)
        return merged

    @staticmethod
    def _type(s: dict[str, Any]) -> str:
        t = s.get("type")
        if isinstance(t, list):
            t = next((x for x in t if x != "null"), "null")
        if isinstance(t, str):
            return t
        if "properties" in s or "additionalProperties" in s:
            return "object"
        if "items" in s or "prefixItems" in s:
            return "array"
        return "string"

    def _typed(self, s: dict[str, Any], t: str, name: str, depth: int) -> Any:
        if t == "object":
            return self._object(s, name, depth)
        if t == "array":
            return self._array(s, name, depth)
        if t == "integer":
            return int(_bounded(s, self.small, integer=True))
        if t == "number":
            return _bounded(s, self.small + 0.5, integer=False)
        if t == "boolean":
            return True
        if t == "null":
            return None
        return self._string(s, name)

    def _object(self, s: dict[str, Any], name: str, depth: int) -> dict[str, Any]:
        props: dict[str, Any] = s.get("properties") or {}
        required = list(s.get("required") or [])
        out: dict[str, Any] = {}
        for pname, pschema in props.items():
            if depth > SOFT_DEPTH and pname not in required:
                continue
            out[pname] = self.fill(pschema, pname, depth + 1)
        extra = s.get("additionalProperties", True)
        extra_schema = extra if isinstance(extra, dict) else {}
        for pname in required:
            if pname not in out:
                out[pname] = self.fill(extra_schema, pname, depth + 1)
        i = 0
        while len(out) < int(s.get("minProperties", 0)) and extra is not False:
            out[f"{name}_{i}"] = self.fill(extra_schema, f"{name}_{i}", depth + 1)
            i += 1
        return out

    def _array(self, s: dict[str, Any], name: str, depth: int) -> list[Any]:
        lo = int(s.get("minItems", 0))
        n = lo if depth > SOFT_DEPTH else max(lo, 1)
        if s.get("maxItems") is not None:
            n = min(n, int(s["maxItems"]))
        prefix = s.get("prefixItems") or []
        items = s.get("items", {})
        out = [self.fill(p, name, depth + 1) for p in prefix]
        if items is False:
            return out
        while len(out) < n:
            i = len(out)
            out.append(self.fill(items, name if i == 0 else f"{name}{i}", depth + 1))
        return out

    def _string(self, s: dict[str, Any], name: str) -> str:
        fmt = s.get("format")
        if fmt in _FORMATS:
            return _FORMATS[fmt]
        base = f"{name}-{self.tag}"
        if fmt == "email":
            base = f"{name}-{self.tag}@example.com"
        elif fmt in ("uri", "url", "iri"):
            base = f"https://example.com/{name}-{self.tag}"
        elif fmt == "uuid":
            return str(uuid.UUID(hashlib.sha1(base.encode()).hexdigest()[:32]))
        lo, hi = int(s.get("minLength", 0)), s.get("maxLength")
        if len(base) < lo:
            base += "x" * (lo - len(base))
        if hi is not None:
            base = base[: int(hi)]
        return base


def _bounded(s: dict[str, Any], want: float, integer: bool) -> float:
    """``want`` moved inside the schema's bounds (and onto ``multipleOf`` when given)."""
    lo, hi = s.get("minimum"), s.get("maximum")
    xlo, xhi = s.get("exclusiveMinimum"), s.get("exclusiveMaximum")
    step = 1 if integer else 1e-6
    if isinstance(xlo, (int, float)) and not isinstance(xlo, bool):
        lo = max(lo, xlo + step) if lo is not None else xlo + step
    if isinstance(xhi, (int, float)) and not isinstance(xhi, bool):
        hi = min(hi, xhi - step) if hi is not None else xhi - step
    if integer:
        lo = math.ceil(lo) if lo is not None else None
        hi = math.floor(hi) if hi is not None else None
    v: float = want
    if lo is not None and hi is not None and lo <= hi:
        if integer:
            v = lo + (want % (hi - lo + 1))
        elif not lo <= want <= hi:
            v = (lo + hi) / 2
    elif lo is not None:
        v = max(want, lo)
    elif hi is not None:
        v = min(want, hi)
    m = s.get("multipleOf")
    if m:
        v = math.ceil(v / m) * m
        if hi is not None and v > hi:
            v -= m
        if integer:
            v = round(v)
    return int(v) if integer else float(v)
