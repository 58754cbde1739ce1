"""vLLM (``vllm://host:port``): OpenAI-compatible, plus batched prompts in vLLM's own template.

Batch prompting sends raw prompts on ``/v1/completions``, where the server applies no chat
template, so they must be rendered here. A hard-coded ChatML is wrong for most models, so this
driver renders with the model's own template through vLLM's public tokenizer API:
``POST /tokenize`` with ``messages`` applies the chat template (``add_generation_prompt``) and
returns token ids, and ``POST /detokenize`` turns them back into text, special tokens kept.
``batch_prompting.ServerTemplate`` makes that two renders per conversation shape, not one per
prompt; a shape whose learned pieces do not reproduce the server's own render of a real
conversation (a template that trims, a decode that cleans up spaces) is rendered by a round
trip per conversation instead. The rendered text already holds BOS, so batched bodies carry
``add_special_tokens: false`` (else vLLM adds a second one).

With ``batch_prompting=True``, ``preflight`` refuses a server whose ``/tokenize`` or
``/detokenize`` does not answer before anything is sent: batched turns would otherwise fail
one by one, or be rendered in a template the model was not trained on. SGLang (``sglang://``)
keeps ChatML: its ``/tokenize`` takes text only.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

from agentbatch.backends.batch_prompting import ServerTemplate, text_conversations
from agentbatch.backends.openai_compat import OpenAICompatBackend
from agentbatch.core.errors import (
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    BatchSpecError,
    ServerError,
)
from agentbatch.core.model_io import Message

if TYPE_CHECKING:
    from agentbatch.core.plan import BatchPlan

TEMPLATE_TIMEOUT_S = 10.0
PROBE: list[Message] = [{"role": "user", "content": "agentbatch preflight"}]


class VLLMBackend(OpenAICompatBackend):
    """``Backend`` for ``vllm serve``; see the module docstring for what it adds."""

    def __init__(self, target: Any, **kwargs: Any) -> None:
        super().__init__(target, **kwargs)
        self._templates: dict[str, ServerTemplate] = {}

    def template(self, model: str) -> ServerTemplate:
        """The template cache for ``model`` (a server may serve several names)."""
        if model not in self._templates:
            self._templates[model] = ServerTemplate(partial(self._apply_template, model=model))
        return self._templates[model]

    async def _post(self, path: str, body: dict[str, Any], key: str, model: str) -> Any:
        """``body[key]`` of vLLM's answer to ``POST path``; ``ServerError`` if it is missing."""
        reply = await self._session.post_json(path, {"model": model, **body}, {},
                                              TEMPLATE_TIMEOUT_S, model_request=False)
        value = reply.get(key) if isinstance(reply, dict) else None
        if value is None:
            raise ServerError(f"{self.name}: POST {path} answered without {key!r}: "
                              f"{str(reply)[:80]!r}", status=200)
        return value

    async def _tokenize(self, messages: list[Message], model: str) -> list[int]:
        tokens = await self._post("/tokenize", {"messages": messages,
                                                "add_generation_prompt": True}, "tokens", model)
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise ServerError(f"{self.name}: POST /tokenize answered no token list", status=200)
        return tokens

    async def _detokenize(self, tokens: list[int], model: str) -> str:
        prompt = await self._post("/detokenize", {"tokens": tokens}, "prompt", model)
        if not isinstance(prompt, str):
            raise ServerError(f"{self.name}: POST /detokenize answered no text", status=200)
        return prompt

    async def _apply_template(self, messages: list[Message], model: str = "") -> str:
        """``messages`` rendered by the model's chat template, generation prompt included."""
        model = model or self.target.model or ""
        return await self._detokenize(await self._tokenize(messages, model), model)

    async def preflight(self, plan: BatchPlan) -> None:
        """With ``batch_prompting``: the server renders its template, or the batch is refused."""
        if not plan.batch_prompting:
            return
        model = plan.model or self.target.model or ""
        path = "/tokenize"
        try:
            tokens = await self._tokenize(PROBE, model)
            path = "/detokenize"
            await self._detokenize(tokens, model)
        except (BackendUnavailable, BackendTimeout):
            raise  # not answering at all: the server is down, not unable
        except BackendError as exc:
            said = f"HTTP {exc.status}" if exc.status not in (None, 200) else "no usable body"
            raise BatchSpecError(
                f"batch_prompting=True cannot apply to backend {self.name}: its POST {path} "
                f"answered {said} ({exc}); batched prompts on vllm:// are rendered with the "
                "model's chat template through vLLM's /tokenize and /detokenize, so point it at "
                "a vLLM OpenAI server, use the scheme of the server that answered, or drop "
                "batch_prompting"
            ) from exc

    async def _batch_prompts(self, prompts: list[str], messages: list[list[Message]] | None,
                             model: str) -> tuple[list[str], dict[str, Any]]:
        """Prompts rendered by the model's template when the conversations are given; the
        text then holds BOS already, so vLLM must not add another."""
        if messages is None:
            return prompts, {}
        rendered = await self.template(model).render_many(text_conversations(messages))
        return rendered, {"add_special_tokens": False}
