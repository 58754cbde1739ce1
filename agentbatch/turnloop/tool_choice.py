"""``tool_choice``: whether an agent must call a tool before it may give its final answer.

- ``"auto"`` (default): the model decides on every turn.
- ``"required"``: until an agent has called a tool, every model turn it takes (repair turns
  included) must be a tool call; after its first tool results the model decides again.
  ``required_tool_rounds=N`` makes that its first N tool rounds (a task that must read N
  pages, say, before it answers).
  OpenAI's ``"required"`` forces a call on every request, which would keep an agent from ever
  answering; for a batch task that needs a tool, one forced round per agent is the meaning.

How it is enforced, by ``tool_calling`` mode:

- ``"json"``: the turn's guided-JSON schema holds only the ``{"tool_calls": [...]}`` form
  (``json_tool_calling.union_schema(allow_final=False)``), so it works on every backend that
  constrains JSON, llama.cpp included.
- ``"native"``: the request carries ``tool_choice="required"`` (``{"type": "any"}`` for
  Anthropic, ``{"any": {}}`` for Bedrock). A backend whose server does not enforce it
  (``capabilities.tool_choice_required`` False) is refused at submit: the option would
  otherwise silently do nothing. llama.cpp is such a server: on the pinned build its
  "required" grammar lets any text come before ``<tool_call>`` (its root rule is
  ``"<|im_start|>assistant\\n" space until-<tool_call>? tool-calls``), so SmolLM2 writes
  prose until ``max_tokens`` and never reaches a call, with its own template and with the
  Qwen2.5, Qwen3 and Hermes-2-Pro tool templates alike.
"""

from __future__ import annotations

from typing import Any, get_args

from agentbatch.core.errors import BatchSpecError
from agentbatch.core.options import ToolChoice

CHOICES = get_args(ToolChoice)


def check_value(value: Any, *, has_tools: bool) -> None:
    """``tool_choice`` is one of ``CHOICES``, and ``"required"`` needs tools to call."""
    if not isinstance(value, str) or value not in CHOICES:
        raise BatchSpecError(f"tool_choice must be 'auto' or 'required', got {value!r}")
    if value == "required" and not has_tools:
        raise BatchSpecError("tool_choice='required' cannot apply to a batch without tools; "
                             "add tools or drop tool_choice")


def check_required_tool_rounds(rounds: int, tool_choice: str, max_turns: int) -> None:
    """``required_tool_rounds`` (a checked integer >= 1) needs ``"required"``, and leaves
    the agent a turn to answer in (``max_turns`` counts the tool rounds' turns too)."""
    if rounds == 1:
        return
    if tool_choice != "required":
        raise BatchSpecError(
            f"required_tool_rounds={rounds} cannot apply with tool_choice={tool_choice!r}: "
            "it counts the rounds tool_choice='required' forces; set tool_choice='required'")
    if rounds >= max_turns:
        raise BatchSpecError(
            f"required_tool_rounds must be < max_turns ({max_turns}), got {rounds}: an agent "
            "forced to call tools on every turn it may take could never answer")


def check_backends(value: str, tool_calling: str, urls: list[str]) -> None:
    """Refuse ``"required"`` in native mode on a backend that does not enforce it."""
    if value != "required" or tool_calling != "native":
        return
    from agentbatch.backends.registry import backend_from_url
    from agentbatch.backends.setup import expand_backend_urls

    for url in expand_backend_urls(urls):
        try:
            backend = backend_from_url(url)  # drivers connect lazily: nothing to close
        except Exception:  # e.g. a key only the workers have: its own error comes later
            continue
        if not backend.capabilities.tool_choice_required:
            raise BatchSpecError(
                f"tool_choice='required' cannot apply to backend {backend.name} with "
                "tool_calling='native': the server does not force a native tool call; use "
                "tool_calling='json' (or 'auto'), which forces it through guided JSON"
            )
