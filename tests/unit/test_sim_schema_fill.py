"""Schema filling: values validate against Pydantic v2 schemas and are deterministic."""

from __future__ import annotations

import datetime as dt
import enum
from typing import Annotated, Literal, Optional, Union

import pytest
from pydantic import BaseModel, Field

from agentbatch.sim.schema_fill import fill_schema
from agentbatch.sim.script import sha1_hex


class Color(str, enum.Enum):
    RED = "red"
    BLUE = "blue"


class Priority(enum.IntEnum):
    LOW = 1
    HIGH = 5


class Address(BaseModel):
    street: str
    zip_code: Annotated[str, Field(min_length=5, max_length=5)]


class Person(BaseModel):
    name: str
    age: Annotated[int, Field(ge=18, le=20)]
    score: Annotated[float, Field(gt=0, lt=1)]
    active: bool
    address: Address
    previous: list[Address]
    nickname: Optional[str] = None  # noqa: UP045 - the Optional spelling is what is tested
    manager: Address | None = None
    color: Color
    priority: Priority = Priority.LOW
    kind: Literal["employee"]
    mood: Literal["happy", "sad"]
    tags: Annotated[list[str], Field(min_length=2)]
    counts: dict[str, int]
    pair: tuple[int, str]
    birthday: dt.date
    updated: dt.datetime


class Cat(BaseModel):
    pet_type: Literal["cat"]
    meows: int


class Dog(BaseModel):
    pet_type: Literal["dog"]
    barks: float


class Owner(BaseModel):
    pet: Annotated[Union[Cat, Dog], Field(discriminator="pet_type")]  # noqa: UP007
    pets: list[Cat | Dog]


class Node(BaseModel):
    value: int
    children: list[Node] = []
    parent: Node | None = None


class Bounded(BaseModel):
    even: Annotated[int, Field(multiple_of=2, ge=3, le=9)]
    negative: Annotated[int, Field(lt=0)]
    big: Annotated[int, Field(ge=1000)]
    ratio: Annotated[float, Field(ge=0.25, le=0.5)]
    items: Annotated[list[int], Field(max_length=0)]


@pytest.mark.parametrize("model", [Person, Owner, Node, Bounded, Address])
def test_filled_value_validates(model: type[BaseModel]):
    value = fill_schema(model.model_json_schema(), "agent-1")
    model.model_validate(value)  # raises on any mismatch


def test_values_are_deterministic_and_keyed():
    schema = Person.model_json_schema()
    a = fill_schema(schema, "agent-1")
    assert a == fill_schema(schema, "agent-1")
    assert a != fill_schema(schema, "agent-2")
    tag = sha1_hex("agent-1")[:8]
    assert a["name"] == f"name-{tag}"
    assert a["color"] == "red" and a["kind"] == "employee" and a["mood"] == "happy"
    assert a["active"] is True
    assert 18 <= a["age"] <= 20 and len(a["tags"]) == 2 and len(a["previous"]) == 1
    assert a["manager"] is not None and "street" in a["manager"]  # Optional: first non-null


def test_plain_schemas():
    assert fill_schema({"type": "null"}) is None
    assert fill_schema({"const": 3}) == 3
    assert fill_schema({"type": ["null", "integer"], "minimum": 5, "maximum": 5}) == 5
    assert fill_schema({"anyOf": [{"type": "null"}, {"type": "boolean"}]}) is True
    assert fill_schema({"default": "x"}) == "x"
    value = fill_schema(
        {
            "allOf": [
                {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
                {"properties": {"b": {"type": "integer"}}},
            ]
        }
    )
    assert set(value) == {"a", "b"}
    numbers = fill_schema({"type": "array", "minItems": 3, "items": {"type": "number"}})
    assert len(numbers) == 3 and all(isinstance(n, float) for n in numbers)
