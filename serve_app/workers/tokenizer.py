"""Tokenizer deployment: chat templates and encoding, batched across calls."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from ray import serve

from actors.tokenizer_file import load_tokenizer
from serve_app import errors
from serve_app.checkpoints.chat_templates import (
    CHECKPOINT_LABEL,
    ChatTemplate,
    renders_tools,
    tools_unsupported_reason,
)
from serve_app.checkpoints.prompt_encoding import PromptEncoder, UnsafePromptError


class TokenizerService:
    def __init__(self, model_path: str, template: ChatTemplate | None = None):
        self.tokenizer = load_tokenizer(model_path)
        if template is not None and template.text is not None:
            self.tokenizer.chat_template = template.text
        self.template = template or ChatTemplate(self.tokenizer.chat_template, CHECKPOINT_LABEL)
        # Decided once: a template that ignores `tools` makes every request's tools a 400.
        self.renders_tools = renders_tools(self.tokenizer)
        # Client text stays text: only the template's own markers become control ids.
        self.prompts = PromptEncoder(self.tokenizer)
        signature = inspect.signature(self.tokenizer.apply_chat_template)
        named = [p.name for p in signature.parameters.values() if p.kind is not p.VAR_KEYWORD]
        # `messages` is what the template itself calls the conversation.
        self._call_parameters = frozenset([*named, "messages"])

    @property
    def chat_template(self) -> str | None:
        return self.tokenizer.chat_template

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The template's ids, adding no special tokens (the template wrote them); control-token
        text in client strings stays text (serve_app/checkpoints/prompt_encoding.py)."""
        if tools and not self.renders_tools:
            raise errors.unsupported_parameter("tools", tools_unsupported_reason(self.template))
        if continue_final_message and add_generation_prompt:
            add_generation_prompt = False
        kwargs = chat_template_kwargs or {}
        self._check_template_kwargs(kwargs)

        def render(extra: dict[str, Any]) -> list[int]:
            return self.prompts.render(
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=extra,
            )

        try:
            return render(kwargs)
        except UnsafePromptError as exc:
            raise errors.invalid_request(str(exc), "messages") from None
        except Exception as exc:  # noqa: BLE001 (template errors are the client's input)
            raise _template_error(exc, render, kwargs) from None

    def _check_template_kwargs(self, kwargs: dict[str, Any]) -> None:
        """Template variables only: a key that names an `apply_chat_template` argument
        would replace the template itself (`chat_template`) or what rendering returns."""
        for name in kwargs:
            if name in self._call_parameters:
                raise errors.invalid_request(
                    f"'chat_template_kwargs.{errors.echo(name)}' is an argument of the "
                    "template call, not a template variable; it cannot be set by a request.",
                    f"chat_template_kwargs.{errors.echo(name)}",
                )

    @serve.batch(max_batch_size=64, batch_wait_timeout_s=0.002)
    async def encode(self, texts: list[str]) -> list[list[int]]:
        """Plain text prompts, encoded as text (the tokenizer's own BOS stays); concurrent
        calls are encoded as one batch."""
        return self.prompts.encode_text(texts)


def _template_error(
    exc: Exception, render: Callable[[dict[str, Any]], object], kwargs: dict[str, Any]
) -> errors.APIError:
    """Blame the part of the request that broke the template: when it renders without the
    request's kwargs, they did (`chat_template_kwargs`); otherwise the `messages`."""
    reason = errors.echo(" ".join(str(exc).split()) or type(exc).__name__)
    if kwargs:
        try:
            render({})
        except Exception:  # noqa: BLE001 (it fails without them too: the messages)
            pass
        else:
            message = f"The chat template failed with these chat_template_kwargs: {reason}"
            return errors.invalid_request(message, "chat_template_kwargs")
    message = f"The chat template failed on these messages: {reason}"
    return errors.invalid_request(message, "messages")
