"""A JSON schema as a whitespace-free GBNF grammar, for llama.cpp's ``grammar`` field.

llama.cpp's own grammar for a ``response_format`` json_schema allows whitespace between every
token, and small models use it; the same value with no whitespace is about half as many
tokens, and on a CPU-bound engine generated tokens are the wall time. ``to_gbnf`` covers the
schemas agentbatch sends (objects, strings, numbers, integers, booleans, null, arrays,
``anyOf``/``oneOf``, local ``$ref``); anything else raises ``Unsupported`` so the caller
sends the schema itself. Two deliberate loosenings, both checked after generation: an array's
``maxItems`` above 1 becomes an open repetition, and ``additionalProperties`` is never
granted. The full list and the measurements: docs/engine-llamacpp.md.
"""

from __future__ import annotations

import json
import re
from typing import Any

CHAR = r'[^"\\\x7F\x00-\x1F] | [\\] (["\\/bfnrt] | "u" [0-9a-fA-F]{4})'
PRIMITIVES = {
    "string": '"\\"" char* "\\""',
    "integer": '"-"? ("0" | [1-9] [0-9]{0,15})',
    "number": '"-"? ("0" | [1-9] [0-9]{0,15}) ("." [0-9]+)? ([eE] [-+]? [0-9]+)?',
    "boolean": '"true" | "false"',
    "null": '"null"',
}
_IGNORED = {"title", "description", "default", "examples", "$schema", "$id", "strict",
            "additionalProperties", "$comment"}
_RULE_RE = re.compile(r"[^a-zA-Z0-9-]+")


class Unsupported(ValueError):
    """The schema uses something ``to_gbnf`` does not translate (send the schema instead)."""


def literal(value: Any) -> str:
    """A GBNF string literal matching ``value`` written as compact JSON."""
    return literal_text(_compact(value))


class _Builder:
    def __init__(self, root: dict[str, Any], space: str) -> None:
        self.root = root
        self.sp = f" {space}" if space else ""
        self.rules: dict[str, str] = {}
        self.refs: dict[str, str] = {}

    def name(self, hint: str) -> str:
        base = _RULE_RE.sub("-", hint).strip("-").lower() or "r"
        name, i = base, 1
        while name in self.rules or name in ("root", "char", *PRIMITIVES):
            i += 1
            name = f"{base}{i}"
        self.rules[name] = ""  # reserved
        return name

    def add(self, hint: str, body: str) -> str:
        name = self.name(hint)
        self.rules[name] = body
        return name

    def visit(self, schema: Any, hint: str) -> str:
        """A GBNF expression for ``schema`` (a rule name or an inline expression)."""
        if schema is True or schema == {}:
            raise Unsupported("a free-form value")
        if not isinstance(schema, dict):
            raise Unsupported(f"schema node {schema!r}")
        unknown = set(schema) - _IGNORED - {
            "type", "properties", "required", "items", "minItems", "maxItems", "enum", "const",
            "anyOf", "oneOf", "$ref", "minLength", "maxLength", "$defs", "definitions"}
        if unknown:
            raise Unsupported(", ".join(sorted(unknown)))
        if "$ref" in schema:
            return self.ref(schema["$ref"])
        if "const" in schema:
            return literal(schema["const"])
        if "enum" in schema:
            return "(" + " | ".join(literal(v) for v in schema["enum"]) + ")"
        for key in ("anyOf", "oneOf"):
            if key in schema:
                alts = [self.visit(s, f"{hint}-{i}") for i, s in enumerate(schema[key])]
                return self.add(hint, " | ".join(alts))
        kind = schema.get("type")
        if isinstance(kind, list):
            return self.add(hint, " | ".join(
                self.visit({**schema, "type": k}, f"{hint}-{k}") for k in kind))
        if kind == "object":
            return self.obj(schema, hint)
        if kind == "array":
            return self.array(schema, hint)
        if kind == "string":
            low = int(schema.get("minLength", 0))
            high = schema.get("maxLength")
            if low == 0 and high is None:
                return "string"
            reps = f"{{{low},{'' if high is None else int(high)}}}"
            return self.add(hint, f'"\\"" char{reps} "\\""')
        if kind in PRIMITIVES:
            return kind
        raise Unsupported(f"type {kind!r}")

    def ref(self, ref: str) -> str:
        if ref in self.refs:
            return self.refs[ref]
        for prefix in ("#/$defs/", "#/definitions/"):
            if ref.startswith(prefix):
                key = ref[len(prefix):]
                defs = self.root.get(prefix[2:-1]) or {}
                if key in defs:
                    name = self.name(key)
                    self.refs[ref] = name
                    self.rules[name] = self.visit(defs[key], key + "-body")
                    return name
        raise Unsupported(f"$ref {ref!r}")

    def obj(self, schema: dict[str, Any], hint: str) -> str:
        props: dict[str, Any] = schema.get("properties") or {}
        if not props:
            raise Unsupported("an object without properties")
        required = set(schema.get("required") or [])
        names = list(props)
        if names[0] not in required:
            raise Unsupported("an object whose first property is optional")
        parts = []
        for i, key in enumerate(names):
            pair = f'{literal(key)} ":"{self.sp} {self.visit(props[key], f"{hint}-{key}")}'
            if i == 0:
                parts.append(pair)
            elif key in required:
                parts.append(f'","{self.sp} {pair}')
            else:
                parts.append(f'(","{self.sp} {pair})?')
        return self.add(hint, '"{" ' + " ".join(parts) + ' "}"')

    def array(self, schema: dict[str, Any], hint: str) -> str:
        item = self.visit(schema.get("items") or True, f"{hint}-item")
        low = int(schema.get("minItems", 0))
        high = schema.get("maxItems")
        if high is not None and int(high) == 0:
            return self.add(hint, '"[" "]"')
        if high is not None and int(high) == 1:
            body = f'"[" {item} "]"' if low >= 1 else f'"[" {item}? "]"'
            return self.add(hint, body)
        more = f'(","{self.sp} {item})*'
        if low >= 1:
            return self.add(hint, f'"[" {item} {more} "]"')
        return self.add(hint, f'"[" ({item} {more})? "]"')


    # -- the forced prefix ------------------------------------------------------------------

    def split(self, schema: Any, hint: str, depth: int = 0) -> tuple[str, list[str]]:
        """(the text every compact value of ``schema`` starts with, the GBNF expressions
        that follow it in order). ``visit`` for anything whose start is not forced."""
        if depth > 16 or not isinstance(schema, dict):
            return "", [self.visit(schema, hint)]
        if "$ref" in schema:
            ref = schema["$ref"]
            for prefix in ("#/$defs/", "#/definitions/"):
                defs = self.root.get(prefix[2:-1]) or {}
                if ref.startswith(prefix) and ref[len(prefix):] in defs:
                    return self.split(defs[ref[len(prefix):]], hint, depth + 1)
            return "", [self.visit(schema, hint)]
        if "const" in schema:
            return _compact(schema["const"]), []
        if "enum" in schema:
            return _common([(_compact(v), []) for v in schema["enum"]], hint, self)
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return _common([self.split(s, f"{hint}-{i}", depth + 1)
                                for i, s in enumerate(schema[key])], hint, self)
        kind = schema.get("type")
        if kind == "object" and schema.get("properties"):
            return self.split_obj(schema, hint, depth)
        if kind == "array" and int(schema.get("minItems", 0)) >= 1 \
                and int(schema.get("maxItems", 2)) >= 1:
            head, rest = self.split(schema.get("items") or True, f"{hint}-item", depth + 1)
            item = self.visit(schema.get("items") or True, f"{hint}-item")
            more = "" if int(schema.get("maxItems", 2)) == 1 else f' (","{self.sp} {item})*'
            return "[" + head, [*rest, more.strip(), '"]"'] if more else [*rest, '"]"']
        if kind == "string" and not {"enum", "const"} & set(schema):
            expr = self.visit(schema, hint)  # '"\"" char... "\""' or ``string``
            body = self.rules.get(expr, PRIMITIVES["string"] if expr == "string" else expr)
            return '"', [body.split(" ", 1)[1]]
        if kind == "null":
            return "null", []
        return "", [self.visit(schema, hint)]

    def split_obj(self, schema: dict[str, Any], hint: str, depth: int) -> tuple[str, list[str]]:
        """An object's opening, first key and its value's forced start; while a required
        value is forced whole (a ``const``), the next key joins the prefix too."""
        props: dict[str, Any] = schema["properties"]
        required = set(schema.get("required") or [])
        names = list(props)
        if names[0] not in required:
            raise Unsupported("an object whose first property is optional")
        prefix, rest = "{", list[str]()
        for i, key in enumerate(names):
            value = props[key]
            if rest or (i > 0 and key not in required):
                pair = f'{literal(key)} ":"{self.sp} {self.visit(value, f"{hint}-{key}")}'
                rest.append(f'","{self.sp} {pair}' if key in required
                            else f'(","{self.sp} {pair})?')
                continue
            head, tail = self.split(value, f"{hint}-{key}", depth + 1)
            prefix += ("," if i > 0 else "") + _compact(key) + ":" + head
            rest.extend(tail)
        return (prefix, [*rest, '"}"']) if rest else (prefix + "}", [])


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _common(parts: list[tuple[str, list[str]]], hint: str,
            builder: _Builder) -> tuple[str, list[str]]:
    """The longest prefix shared by every alternative (each then keeps what follows it)."""
    heads = [head for head, _ in parts]
    shared = heads[0]
    for head in heads[1:]:
        while not head.startswith(shared):
            shared = shared[:-1]
    # every alternative must still produce something after the shared text
    while shared and any(h == shared and not r for h, r in parts):
        shared = shared[:-1]
    if not shared:
        alts = [" ".join([literal_text(h), *r]).strip() for h, r in parts]
        return "", [builder.add(hint, " | ".join(f"({a})" for a in alts))]
    alts = [" ".join([literal_text(h[len(shared):]), *r]).strip() for h, r in parts]
    return shared, [builder.add(hint, " | ".join(f"({a})" for a in alts))]


def literal_text(text: str) -> str:
    """A GBNF literal for raw ``text`` ("" for none)."""
    if not text:
        return ""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def split_gbnf(schema: dict[str, Any]) -> tuple[str, str] | None:
    """(forced prefix, grammar for the rest) of ``schema``'s compact values, for a server that
    continues a prefilled reply: the prefix costs no decode steps. None when nothing is forced
    or nothing is left to generate. ``Unsupported`` as ``to_gbnf``."""
    builder = _Builder(schema, "")
    prefix, rest = builder.split(
        {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}, "value")
    rest = [r for r in rest if r]
    if rest and rest[0].startswith("char"):
        # The reply would go on with a free string: prefilled up to its opening quote,
        # SmolLM2 lost the thread (tests/engine/test_engine_json_tools.py, a free-string tool
        # argument under tool_choice="required": 3-7 of 8 agents valid in six runs, against
        # 8 of 8 in four runs without the prefill; cutting the prefix back to ``{"tool_calls":[``
        # still gave 7 and 7). A value from a fixed set (an enum, as in the verdict and the
        # benchmark's tool) kept every reply valid, so only those starts are prefilled.
        return None
    if not prefix or not rest:
        return None
    return prefix, _grammar(builder, " ".join(rest))


def to_gbnf(schema: dict[str, Any], *, space: str = "") -> str:
    """``schema`` as a GBNF grammar producing compact JSON; ``Unsupported`` if it cannot.

    ``space``: a GBNF expression allowed after each ``:`` and ``,`` (e.g. ``'" "?'``).
    """
    builder = _Builder(schema, space)
    top = builder.visit({k: v for k, v in schema.items() if k not in ("$defs", "definitions")},
                        "value")
    return _grammar(builder, top)


def _grammar(builder: _Builder, top: str) -> str:
    """The grammar text: ``root ::= top``, the builder's rules and the primitives used."""
    lines = [f"root ::= {top}"]
    lines += [f"{name} ::= {body}" for name, body in builder.rules.items()]
    text = "\n".join(lines)
    used = set(re.findall(r"\b(string|integer|number|boolean|null|char)\b", text))
    if "string" in used:
        lines.append(f"string ::= {PRIMITIVES['string']}")
        used.add("char")
    for kind in ("integer", "number", "boolean", "null"):
        if kind in used and not any(line.startswith(f"{kind} ::=") for line in lines):
            lines.append(f"{kind} ::= {PRIMITIVES[kind]}")
    if "char" in used:
        lines.append(f"char ::= {CHAR}")
    return "\n".join(lines) + "\n"
