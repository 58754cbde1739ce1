"""Output schemas the grammar tests translate: one of every shape agentbatch's GBNF covers."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class Inner(BaseModel):
    n: int
    ok: bool | None = None


class Outer(BaseModel):
    kind: Literal["a", "b"]
    name: str = Field(max_length=5)
    inner: Inner
    tags: list[str]
    score: float
