"""Tokenizer deployment: chat templates, encoding and token-id checks, batched across calls."""

from __future__ import annotations

from typing import Any

from ray import serve
from transformers import AutoTokenizer

from serve_app import errors


class TokenizerService:
    def __init__(self, model_path: str, vocab_size: int):
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.vocab_size = vocab_size

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
        """Render with the model's template, then encode without adding special tokens
        (the template already wrote them)."""
        if continue_final_message and add_generation_prompt:
            add_generation_prompt = False
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **(chat_template_kwargs or {}),
            )
        except Exception as exc:  # noqa: BLE001 (template errors are the client's input)
            raise errors.invalid_request(f"chat template failed: {exc}", "messages") from exc
        return self.tokenizer.encode(text, add_special_tokens=False)

    @serve.batch(max_batch_size=64, batch_wait_timeout_s=0.002)
    async def encode(self, texts: list[str]) -> list[list[int]]:
        """Plain text prompts; concurrent calls are encoded as one batch."""
        return self.tokenizer(texts, add_special_tokens=True)["input_ids"]

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        """Client-supplied ids: special tokens are taken as given, never added."""
        for t in token_ids:
            if not 0 <= t < self.vocab_size:
                raise errors.invalid_request(
                    f"token id {t} is outside the vocabulary [0, {self.vocab_size})", param
                )
