"""The simulator's own chat template and tokenizer (behind ``/tokenize`` and ``/detokenize``),
and its scripted model reading directives from prompts rendered with them."""

from __future__ import annotations

import pytest

from agentbatch.sim.model import plan_completion
from agentbatch.sim.tokens import decode, encode, render_template

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "@sim answer first line\nmore"},
]


def test_template_is_not_chatml_and_opens_the_reply() -> None:
    text = render_template(CONVERSATION)
    assert text == ("<|sim:system|>\nBe brief.\n<|sim:user|>\n@sim answer first line\nmore\n"
                    "<|sim:assistant|>\n")
    assert "<|im_start|>" not in text
    assert not render_template(CONVERSATION, add_generation_prompt=False).endswith(
        "<|sim:assistant|>\n")


def test_tokens_round_trip_exactly() -> None:
    text = render_template([{"role": "user", "content": "héllo ✓ {x} \u2063slot\u2063"}])
    assert decode(encode(text)) == text
    with pytest.raises(ValueError):
        decode([-1])
    with pytest.raises(ValueError):
        decode([True])  # type: ignore[list-item]


@pytest.mark.parametrize("content", ["@sim answer done", "Task.\n@sim answer done",
                                     "Task.\n@sim answer done\nThanks."])
def test_scripted_model_reads_directives_from_rendered_prompts(content: str) -> None:
    prompt = render_template([{"role": "system", "content": "sys"},
                              {"role": "user", "content": content}])
    assert plan_completion(prompt, {}).text == "done"
