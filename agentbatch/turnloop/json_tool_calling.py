"""Tool calling through guided JSON (``tool_calling="json"``).

Many servers constrain output to a JSON schema reliably but parse tool calls badly: small
models whose chat template has no tool format, llama.cpp builds whose ``tool_choice`` is not
enforced. In json mode every model turn is constrained to ONE schema, the union of

- ``{"tool_calls": [{"name": <a tool>, "arguments": <its arguments>}, ...]}`` and
- ``{"final": <the output schema, or a string when there is none>}``,

native ``tools`` are not sent, and the system message describes the format and the tools.

Everything happens at the IO edge (``turn_io.call_model``), so the state machine, coalescing,
streaming results and repair turns are the same in both modes:

- ``adapt_request`` swaps native tools for the union schema and renders the history: an
  assistant turn is its JSON reply, tool results become one user message (servers without a
  tool template cannot render ``role: tool``).
- ``parse_reply`` turns a ``{"tool_calls": ...}`` reply into ``ModelResponse.tool_calls``. Any
  other reply stays text, and ``final_parser`` (the policy's output check) unwraps
  ``{"final": ...}``; a reply that is neither form fails that check, so it gets the usual
  repair turn. The raw JSON reply is kept as the assistant message (and as ``result.text``);
  calls are rendered back as compact canonical JSON.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, get_args

from agentbatch.core.errors import BatchSpecError
from agentbatch.core.model_io import Message, ModelRequest, ModelResponse, ToolCall, canonical_json
from agentbatch.core.options import ToolCalling
from agentbatch.core.output import OutputContract, ParsedOutput
from agentbatch.core.repair import RepairError, extract_json

MODES = get_args(ToolCalling)
SCHEMA_NAME = "agent_turn"
FORMAT_ERROR = ('the reply must be one JSON object, either {"tool_calls": [{"name": ..., '
                '"arguments": {...}}]} or {"final": ...}')
RESULTS_HEADER = "Tool results, in call order:"
# Without this line SmolLM2-135M called the same tool again on every turn until max_turns;
# with it, it answered (tests/engine/test_engine_json_tools.py).
RESULTS_FOOTER = 'If these results answer the question, reply with {"final": ...} now.'


# --- choosing the mode --------------------------------------------------------------------


def resolve_mode(mode: str, capabilities: Iterable[Any], *, has_tools: bool,
                 native_json_schema: bool, backend_names: Iterable[str] = ()) -> str:
    """``"json"`` or ``"native"`` for the plan; refuses a json mode that cannot apply.

    ``capabilities``: the ``BackendCapabilities`` of every endpoint (None where unknown).
    ``"auto"`` picks json when some endpoint cannot force a native tool call
    (``tool_choice_required=False``, e.g. llama.cpp) and every endpoint constrains JSON.
    """
    caps = list(capabilities)
    names = list(backend_names) or ["?"] * len(caps)
    if mode == "native" or (mode == "auto" and not has_tools):
        return "native"
    guided = [c is None or c.native_json_schema for c in caps]
    if mode == "auto":
        weak_tools = any(c is not None and not c.tool_choice_required for c in caps)
        return "json" if weak_tools and native_json_schema and all(guided) else "native"
    if not has_tools:
        raise BatchSpecError("tool_calling='json' cannot apply to a batch without tools; "
                             "drop tool_calling or add tools")
    if not native_json_schema:
        raise BatchSpecError("tool_calling='json' needs the schema sent to the server, but "
                             "native_json_schema=False turns that off; set "
                             "native_json_schema=True or tool_calling='native'")
    for name, ok in zip(names, guided, strict=True):
        if not ok:
            raise BatchSpecError(f"tool_calling='json' cannot apply to backend {name}: it does "
                                 "not constrain replies to a JSON schema; use "
                                 "tool_calling='native'")
    return "json"


def mode_for_backends(mode: str, urls: list[str], *, has_tools: bool,
                      native_json_schema: bool) -> str:
    """``resolve_mode`` for the batch's backend URLs (drivers are built lazily: no IO)."""
    if mode == "native" or (not has_tools and mode == "auto"):
        return "native"
    from agentbatch.backends.registry import backend_from_url
    from agentbatch.backends.setup import expand_backend_urls

    caps: list[Any] = []
    names: list[str] = []
    for url in expand_backend_urls(urls):
        try:
            backend = backend_from_url(url)
        except Exception:  # e.g. a key only the workers have: judged when the batch runs
            caps.append(None)
            names.append(url)
            continue
        caps.append(backend.capabilities)
        names.append(backend.name)
    return resolve_mode(mode, caps, has_tools=has_tools,
                        native_json_schema=native_json_schema, backend_names=names)


def check_mode(value: Any) -> None:
    if not isinstance(value, str) or value not in MODES:
        raise BatchSpecError(f"tool_calling must be one of 'native', 'json', 'auto', "
                             f"got {value!r}")


# --- the schema ---------------------------------------------------------------------------


def _lift_defs(schema: dict[str, Any], prefix: str, defs: dict[str, Any]) -> dict[str, Any]:
    """``schema`` without its ``$defs``, moved into ``defs`` under ``prefix`` (refs rewritten).

    Nested in the union, a sub-schema's ``#/$defs/X`` would resolve against the union's root;
    each source gets its own prefix so two tools' ``X`` cannot collide.
    """
    schema = copy.deepcopy(schema)
    local = schema.pop("$defs", None) or {}
    local.update(schema.pop("definitions", None) or {})
    if not local:
        return schema
    renamed = {name: f"{prefix}{name}" for name in local}

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str):
                for old in ("#/$defs/", "#/definitions/"):
                    if ref.startswith(old) and ref[len(old):] in renamed:
                        node = {**node, "$ref": "#/$defs/" + renamed[ref[len(old):]]}
            return {k: rewrite(v) for k, v in node.items()}
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    for name, sub in local.items():
        defs[renamed[name]] = rewrite(sub)
    return rewrite(schema)


def _tool_parts(tool_schemas: list[dict[str, Any]]) -> list[tuple[str, str, dict[str, Any]]]:
    """(name, description, parameters) of each OpenAI function-tool entry."""
    parts = []
    for entry in tool_schemas:
        fn = entry.get("function", entry)
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        parts.append((fn["name"], fn.get("description") or "", params))
    return parts


def union_schema(tool_schemas: list[dict[str, Any]], output_schema: dict[str, Any] | None,
                 *, allow_tools: bool = True, allow_final: bool = True,
                 max_calls: int | None = None) -> dict[str, Any]:
    """The one schema a json-mode turn must fit: only the final form when tools are off, only
    the calls form when a tool call is required (``tool_choice="required"``)."""
    defs: dict[str, Any] = {}
    final_value = (_lift_defs(output_schema, "output_", defs) if output_schema is not None
                   else {"type": "string"})
    final = {"type": "object", "properties": {"final": final_value}, "required": ["final"],
             "additionalProperties": False}
    variants: list[dict[str, Any]] = []
    if allow_tools and tool_schemas:
        calls = []
        for i, (name, _, params) in enumerate(_tool_parts(tool_schemas)):
            calls.append({
                "type": "object",
                "properties": {"name": {"type": "string", "const": name},
                               "arguments": _lift_defs(params, f"tool{i}_", defs)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            })
        array: dict[str, Any] = {"type": "array", "minItems": 1,
                                 "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if max_calls is not None:
            array["maxItems"] = max_calls
        variants.append({"type": "object", "properties": {"tool_calls": array},
                         "required": ["tool_calls"], "additionalProperties": False})
    if allow_final or not variants:  # a turn always has some form to fill
        variants.append(final)
    schema: dict[str, Any] = variants[0] if len(variants) == 1 else {"anyOf": variants}
    if defs:
        schema = {**schema, "$defs": defs}
    return schema


def instructions(tool_schemas: list[dict[str, Any]], output_schema: dict[str, Any] | None,
                 *, schema_shown: bool = False) -> str:
    """The format and the tools, for the shared system message (byte-identical per batch).

    ``schema_shown``: the caller's system prompt already holds the output schema; refer to
    it instead of repeating it."""
    lines = [
        "Reply with exactly one JSON object and nothing else, in one of two forms.",
        'To call tools: {"tool_calls": [{"name": "<tool name>", "arguments": {...}}]} '
        "(one or more calls; their results come back in the next message).",
    ]
    if output_schema is None:
        lines.append('To give your final answer: {"final": "<your answer as a string>"}.')
    elif schema_shown:
        lines.append('To give your final answer: {"final": <an object matching the output '
                     "JSON schema given above>}.")
    else:
        lines.append('To give your final answer: {"final": <an object matching this JSON '
                     f"schema>}}:\n{canonical_json(output_schema)}")
    lines.append("Tools:")
    for name, description, params in _tool_parts(tool_schemas):
        summary = " ".join(description.split())
        lines.append(f"- {name}: {summary}\n  arguments schema: {canonical_json(params)}")
    return "\n".join(lines)


# --- requests -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Schemas:
    tools: dict[str, Any]  # tool calls or the final answer
    final: dict[str, Any]  # repair turns: the final answer only
    calls: dict[str, Any]  # tool_choice="required" turns: tool calls only


_CACHE: dict[tuple[str, float], tuple[int, _Schemas]] = {}


def _schemas(plan: Any) -> _Schemas:
    """The plan's two turn schemas, built once per plan object (not once per turn)."""
    key = (plan.batch_id, plan.created_at)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] == id(plan):
        return hit[1]
    built = _Schemas(
        tools=union_schema(plan.tool_schemas, plan.output_json_schema,
                           max_calls=plan.max_tool_calls_per_turn),
        final=union_schema(plan.tool_schemas, plan.output_json_schema, allow_tools=False),
        calls=union_schema(plan.tool_schemas, plan.output_json_schema, allow_final=False,
                           max_calls=plan.max_tool_calls_per_turn),
    )
    if len(_CACHE) >= 256:
        _CACHE.clear()
    _CACHE[key] = (id(plan), built)
    return built


def _compact(value: Any) -> str:
    """Whitespace-free JSON in the value's own key order (the order the model wrote)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _call_pairs(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each OpenAI-form call part as ``{"name", "arguments"}``, arguments decoded."""
    calls = []
    for part in parts:
        fn = part.get("function") or {}
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except ValueError:
            args = fn.get("arguments")
        calls.append({"name": fn.get("name"), "arguments": args})
    return calls


def _calls_json(content: str | None, parts: list[dict[str, Any]]) -> str:
    """The assistant turn that asked for ``parts``: the model's own reply, made compact.

    Repeating the reply as the model wrote it (key order included) keeps the next turn's
    prompt equal, token for token, to what the engine already holds for this conversation,
    so its prefix cache covers the reply: re-rendered with sorted keys, llama-server
    recomputed the whole reply on every agent's next turn (~20 of its ~74 new prompt tokens
    on bench_engine's tools workload). A reply that is not plain JSON saying these calls
    (code fences, prose, a native reply with no text) is rendered from the calls instead,
    in the documented ``{"name", "arguments"}`` order.
    """
    calls = _call_pairs(parts)
    try:
        said = json.loads(content) if content else None
    except ValueError:
        said = None
    if isinstance(said, dict) and isinstance(said.get("tool_calls"), list) \
            and canonical_json(said["tool_calls"]) == canonical_json(calls):
        return _compact(said)
    return _compact({"tool_calls": calls})


def render_history(messages: list[Message]) -> list[Message]:
    """``messages`` as a server without a tool template can take them.

    An assistant turn with calls becomes its calls as compact JSON, whatever whitespace the
    model wrote (SmolLM2 copied the compact form into its next replies: fewer tokens), in
    the model's own key order (``_calls_json``);
    each run of tool results becomes ONE user message, one JSON line per result, in order,
    then a line inviting the final answer.
    """
    out: list[Message] = []
    names: dict[str, dict[str, Any]] = {}
    results: list[str] = []

    def flush() -> None:
        if results:
            out.append({"role": "user",
                        "content": "\n".join([RESULTS_HEADER, *results, RESULTS_FOOTER])})
            results.clear()

    for msg in messages:
        role = msg.get("role")
        if role == "tool":
            call = names.get(msg.get("tool_call_id") or "", {})
            results.append(canonical_json({"name": call.get("name"),
                                           "arguments": call.get("arguments"),
                                           "result": msg.get("content")}))
            continue
        flush()
        if role == "assistant" and msg.get("tool_calls"):
            for part, call in zip(msg["tool_calls"], _call_pairs(msg["tool_calls"]),
                                  strict=True):
                names[part.get("id") or ""] = call
            out.append({"role": "assistant",
                        "content": _calls_json(msg.get("content"), msg["tool_calls"])})
        else:
            out.append(msg)
    flush()
    return out


def adapt_request(plan: Any, request: ModelRequest, *, allow_tools: bool,
                  require_tools: bool = False) -> ModelRequest:
    """``request`` (rendered for native tools) as a json-mode request."""
    schemas = _schemas(plan)
    schema = (schemas.calls if require_tools else schemas.tools if allow_tools
              else schemas.final)
    return request.model_copy(update={
        "messages": render_history(request.messages),
        "tools": [],
        "tool_choice": None,
        "json_schema": {"name": SCHEMA_NAME, "schema": schema},
    })


# --- replies ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reading:
    """What a json-mode reply says: tool calls, a final value, or why it is neither."""

    calls: list[ToolCall] | None = None
    final: Any = None
    has_final: bool = False
    error: str | None = None


def read_reply(text: str | None, *, turn: int = 0) -> Reading:
    """Interpret one reply. Call ids are ``jc<turn>_<i>``: deterministic, unique per agent."""
    try:
        value = extract_json(text)
    except RepairError as exc:
        return Reading(error=f"{exc}; {FORMAT_ERROR}")
    if not isinstance(value, dict):
        return Reading(error=FORMAT_ERROR)
    if "final" in value and "tool_calls" not in value:
        return Reading(final=value["final"], has_final=True)
    raw = value.get("tool_calls")
    if raw is None:
        return Reading(error=FORMAT_ERROR)
    if not isinstance(raw, list) or not raw:
        return Reading(error='"tool_calls" must be a non-empty list of calls')
    calls: list[ToolCall] = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) \
                or not item["name"]:
            return Reading(error=f'tool_calls[{i}] must be an object with a "name" string '
                                 'and an "arguments" object')
        args = item.get("arguments", {})
        call_id = f"jc{turn}_{i}"
        if isinstance(args, dict):
            calls.append(ToolCall(id=call_id, name=item["name"], arguments=args))
        else:
            calls.append(ToolCall(id=call_id, name=item["name"],
                                  arguments_error="the arguments must be a JSON object, got "
                                                  f"{canonical_json(args)[:200]}"))
    return Reading(calls=calls)


def parse_reply(response: ModelResponse, *, allow_tools: bool, turn: int) -> ModelResponse:
    """``response`` with a ``{"tool_calls": ...}`` reply turned into its tool calls.

    The text is kept (it is the assistant message the next turn repeats). Any other reply is
    left as text for ``final_parser``; calls on a turn that allows none are not run either.
    """
    if response.tool_calls or not allow_tools:
        return response
    reading = read_reply(response.text, turn=turn)
    if not reading.calls:
        return response
    return response.model_copy(update={"tool_calls": reading.calls,
                                       "finish_reason": "tool_calls"})


def final_parser(contract: OutputContract) -> Callable[[str | None], ParsedOutput]:
    """The policy's output check in json mode: unwrap ``{"final": ...}``, then validate."""

    def parse(text: str | None) -> ParsedOutput:
        reading = read_reply(text)
        if not reading.has_final:
            if reading.calls:
                return ParsedOutput(False, error="tool calls are not allowed in this reply; "
                                                 'give the final answer as {"final": ...}')
            return ParsedOutput(False, error=reading.error or FORMAT_ERROR)
        final = reading.final
        if contract.schema is None:
            if isinstance(final, str):
                return contract.parse(final)
            return ParsedOutput(False, error='"final" must be a string')
        return contract.parse(final if isinstance(final, str) else canonical_json(final))

    return parse
