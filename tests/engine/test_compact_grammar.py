"""Compact JSON on llama.cpp: a JSON schema sent as a whitespace-free GBNF grammar.

The unit tests check the translation and the request body; the ``engine`` test checks that a
real ``llama-server`` takes the grammar and that SmolLM2's replies come back compact, valid
and shorter than under ``response_format`` (which lets it pretty-print).
"""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest

from agentbatch.backends.gbnf import Unsupported, literal, to_gbnf
from agentbatch.backends.llamacpp import LlamaCppBackend
from agentbatch.backends.registry import backend_from_url
from agentbatch.core.model_io import ModelRequest
from agentbatch.core.output import OutputContract
from agentbatch.turnloop.json_tool_calling import union_schema
from tests.engine.reviews import REVIEWS, TASK, Verdict
from tests.engine.schemas import Outer


def _rules(grammar: str) -> dict[str, str]:
    return dict(line.split(" ::= ", 1) for line in grammar.strip().splitlines())


def test_a_pydantic_model_becomes_a_grammar_without_whitespace() -> None:
    rules = _rules(to_gbnf(Outer.model_json_schema()))
    assert set(rules) >= {"root", "char", "string", "number", "integer", "boolean", "null"}
    body = rules[rules["root"]]
    assert body.startswith('"{" "\\"kind\\"" ":" ("\\"a\\"" | "\\"b\\"") ","')
    text = "\n".join(rules.values())
    assert "space" not in rules and '"\\n"' not in text and "[ \\t]" not in text
    assert any('char{0,5}' in v for v in rules.values())  # maxLength kept
    assert '("," "\\"ok\\"" ":"' in text  # an optional property stays optional


def test_the_tool_union_allows_open_call_lists_and_one_call_when_capped() -> None:
    tools = [{"type": "function", "function": {
        "name": "price", "parameters": {"type": "object", "properties": {
            "item": {"type": "string"}}, "required": ["item"]}}}]
    out = OutputContract(Verdict).json_schema
    many = _rules(to_gbnf(union_schema(tools, out, max_calls=32)))
    one = _rules(to_gbnf(union_schema(tools, out, max_calls=1)))
    assert any(v.endswith(')* "]"') for v in many.values())  # no {0,31} expansion
    assert not any(")*" in v and "tool-calls" in k for k, v in one.items())
    assert any(v.startswith('"{" "\\"final\\"" ":"') for v in one.values())


@pytest.mark.parametrize("schema", [
    {"type": "string", "pattern": "^a+$"},
    {"type": "object", "properties": {"d": {"type": "string", "format": "date"}}},
    {"type": "object"},
    {"allOf": [{"type": "string"}]},
    {"type": "object", "properties": {"a": {"type": "string"}}, "required": []},
])
def test_what_it_cannot_translate_is_refused(schema: dict[str, Any]) -> None:
    with pytest.raises(Unsupported):
        to_gbnf(schema)


def test_literals_escape_quotes_and_backslashes() -> None:
    assert literal('a"b\\c') == '"\\"a\\\\\\"b\\\\\\\\c\\""'


def _request() -> ModelRequest:
    return ModelRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                        json_schema={"name": "v", "schema": Verdict.model_json_schema()})


def test_the_llamacpp_body_carries_the_grammar_not_the_schema() -> None:
    backend = backend_from_url("llamacpp://127.0.0.1:1")
    assert isinstance(backend, LlamaCppBackend)
    whole = LlamaCppBackend(backend.target, jump_forward=False).build_body(_request())
    assert "response_format" not in whole
    assert whole["grammar"] == to_gbnf(Verdict.model_json_schema())
    # by default the forced start is prefilled and the grammar covers the rest
    body = backend.build_body(_request())
    assert "response_format" not in body
    assert body["messages"][-1] == {"role": "assistant", "content": '{"label":"'}
    assert body["grammar"].startswith("root ::= ")
    assert body["grammar"] != whole["grammar"]


def test_compact_json_off_or_an_untranslatable_schema_sends_the_schema() -> None:
    off = LlamaCppBackend(backend_from_url("llamacpp://127.0.0.1:1").target, compact_json=False)
    body = off.build_body(_request())
    assert "grammar" not in body and body["response_format"]["type"] == "json_schema"
    on = backend_from_url("llamacpp://127.0.0.1:1")
    req = _request().model_copy(update={"json_schema": {
        "name": "p", "schema": {"type": "object", "properties": {
            "d": {"type": "string", "pattern": "^[0-9]+$"}}, "required": ["d"]}}})
    body = on.build_body(req)
    assert "grammar" not in body and body["response_format"]["type"] == "json_schema"


def _post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def _tokens(url: str, text: str) -> int:
    return len(_post(url, "/tokenize", {"content": text})["tokens"])


@pytest.mark.engine
def test_llama_server_takes_the_grammar_and_replies_compactly(llama_server: Any) -> None:
    """Every reply is valid, compact JSON; the same value pretty-printed, as llama.cpp's own
    schema grammar lets SmolLM2 write it, is more tokens (counted by the server)."""
    url = llama_server.http_url
    backend = backend_from_url(llama_server.llamacpp_url + "?stream=0")  # whole replies here
    schema = Verdict.model_json_schema()
    compact = pretty = 0
    for i, text in enumerate(REVIEWS[:4]):
        messages = [{"role": "user", "content": TASK.format(i=i, text=text)}]
        request = ModelRequest(model="smollm2", messages=messages, max_tokens=64,
                               temperature=0.0, json_schema={"name": "v", "schema": schema})
        body = backend.build_body(request)
        assert "grammar" in body and "response_format" not in body
        content = _post(url, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
        value = Verdict.model_validate_json(content)
        assert content == json.dumps(value.model_dump(), separators=(",", ":"),
                                     ensure_ascii=False)
        compact += _tokens(url, content)
        pretty += _tokens(url, json.dumps(value.model_dump(), indent=2, ensure_ascii=False))
    print(f"tokens for 4 verdicts: {compact} compact vs {pretty} pretty-printed")
    assert compact < pretty
