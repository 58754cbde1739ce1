import pytest
from pydantic import BaseModel

from agentbatch.core.output import OutputContract
from agentbatch.core.repair import RepairError, extract_json


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"a": 1}', {"a": 1}),
        ('```json\n{"a": 1}\n```', {"a": 1}),
        ('```\n{"a": [1, 2,]}\n```', {"a": [1, 2]}),
        ('Sure! Here you go: {"a": {"b": "x}y"}} Hope that helps.', {"a": {"b": "x}y"}}),
        ('{"a": 1,}', {"a": 1}),
        ('[{"a": 1}]', [{"a": 1}]),
        ('noise {"a": "\\"quoted\\" {brace"} more', {"a": '"quoted" {brace'}),
        ('{"a": "ünïcode ✓"}', {"a": "ünïcode ✓"}),
    ],
)
def test_extract_json_recovers(text, expected):
    assert extract_json(text) == expected


@pytest.mark.parametrize("text", [None, "", "   ", "no json here", 'Sure! {"oops": ', "{bad}"])
def test_extract_json_refuses(text):
    with pytest.raises(RepairError):
        extract_json(text)


class Report(BaseModel):
    file: str
    bugs: list[str]


def test_contract_validates_and_reports_schema_errors():
    contract = OutputContract(Report)
    ok = contract.parse('```json\n{"file": "a.py", "bugs": ["x",],}\n```')
    assert ok.ok and ok.value == {"file": "a.py", "bugs": ["x"]}
    bad = contract.parse('{"file": "a.py"}')
    assert not bad.ok and "bugs" in bad.error
    assert isinstance(contract.instance(ok.value), Report)


def test_contract_array_is_not_an_object():
    # the predecessor silently took the first element of an array; we report the shape
    parsed = OutputContract(Report).parse('[{"file": "a", "bugs": []}]')
    assert not parsed.ok


def test_free_text_contract():
    contract = OutputContract(None)
    assert contract.parse("hello").value == "hello"
    assert not contract.parse("  ").ok
    assert contract.instructions() == ""


def test_schema_instructions_are_byte_identical():
    assert OutputContract(Report).instructions() == OutputContract(Report).instructions()
    assert "```json" in OutputContract(Report).instructions()
