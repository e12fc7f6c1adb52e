"""Prompts to token ids with client text encoded as text: only the chat template's own markers
become control ids.

A chat template writes control markers (`<|im_start|>`, `<tool_call>`, `<think>`, ...) around
client strings. Encoding the rendered prompt whole would turn marker text *inside* a client string
into the real control ids too, so a user could close their turn and open a `system` one. So every
control-token string in client text is wrapped in private-use marks before rendering, and after
rendering the marked occurrences are encoded as plain text, everything else as the template wrote
it. Marking the occurrences, not whole strings, keeps templates that trim, split or JSON-quote
content correct: the marks travel with the token text. (transformers 5.24 ships the same
technique as `apply_chat_template(sanitize_control_tokens=True)`; this one also covers text
prompts, counts every added token as a control token, does not need that new API, and encodes
the common case in one call to the Rust tokenizer.)

Client text that spells no control token encodes exactly as before: one encode of the whole
rendering, so benign prompts, their prefix-cache keys and parity with transformers are unchanged.
"""

from __future__ import annotations

import json
import re
from itertools import compress
from typing import Any

from tokenizers import Encoding, Tokenizer

# Supplementary private-use code points: no tokenizer text uses them, and they are dropped from
# client strings first so nobody can forge a mark.
MARK_START = "\U000f0000"
MARK_END = "\U000f0001"
# How an ASCII-only `tojson` would spell the marks; seeing it means the marks were lost.
_ESCAPED_MARKS = ("\\udb80\\udc00", "\\udb80\\udc01")


class UnsafePromptError(ValueError):
    """Client text could not be kept as text (the template rewrote the marks around it, or the
    tokenizer spells a control token from plain text): refused rather than encoded unsafely."""


class PromptEncoder:
    """Encodes chats (through the tokenizer's chat template) and text prompts for one tokenizer.

    Control tokens are all the tokenizer's added tokens, special or not, except whitespace-only
    ones (which templates and text share). Plain text goes through the tokenizer's own
    normalizer, pre-tokenizer and model with no added token matched.
    """

    def __init__(self, tokenizer: Any):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError("prompt encoding needs a fast tokenizer (a tokenizer.json)")
        self.tokenizer = tokenizer
        self._backend: Tokenizer = backend
        self._plain = _without_added_tokens(backend)
        decoder = tokenizer.added_tokens_decoder
        added = {i: t.content for i, t in decoder.items() if t.content.strip()}
        self.control_ids = frozenset(added)
        # Longest first, so a token wins over the tokens it contains.
        longest_first = sorted(set(added.values()), key=len, reverse=True)
        alternation = "|".join(map(re.escape, longest_first)) or "(?!)"
        self._control_re = re.compile(alternation)
        self._marked_re = re.compile(
            f"{MARK_START}({alternation}){MARK_END}|[{MARK_START}{MARK_END}]"
        )
        self._newline_ids = self._plain.encode("\n", add_special_tokens=False).ids

    @property
    def chat_template(self) -> str | None:
        return self.tokenizer.chat_template

    def encode_text(self, texts: list[str], *, add_special_tokens: bool = True) -> list[list[int]]:
        """Text prompts: the whole string is client text. Ids the tokenizer's post-processor
        adds (a BOS) stay; the text itself never becomes a control id."""
        encodings = self._plain.encode_batch(texts, add_special_tokens=add_special_tokens)
        for encoding in encodings:
            self._check_plain(encoding)
        return [encoding.ids for encoding in encodings]

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The chat template's prompt ids. Template errors propagate as raised (they are about
        the client's input); lost marks raise UnsafePromptError."""
        marks = _Marks(self._control_re)
        text = self.tokenizer.apply_chat_template(
            marks.apply(messages),
            tools=marks.apply(tools),
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **marks.apply(chat_template_kwargs or {}),
        )
        if not marks.num_marked:
            return self._backend.encode(text, add_special_tokens=False).ids
        return self._encode_marked(text)

    def _encode_marked(self, text: str) -> list[int]:
        lowered = text.lower()
        if any(escaped in lowered for escaped in _ESCAPED_MARKS):
            raise UnsafePromptError(
                "the chat template escaped client text that spells a control token, so it "
                "cannot be kept as text; remove the control-token text from the request"
            )
        # [text, marked token, text, marked token, ..., text]; None for a lone mark (a template
        # string method cut the pair apart: dropped, but still a break, so the text on either
        # side cannot join into a control token).
        pieces = self._marked_re.split(text)
        ids = self._backend.encode(pieces[0], add_special_tokens=False).ids
        for i, piece in enumerate(pieces[1:], start=1):
            if piece:
                ids += self._encode_piece(piece, as_text=i % 2 == 1)
        return ids

    def _encode_piece(self, piece: str, *, as_text: bool) -> list[int]:
        """A piece from the middle of a prompt. Encoded after a newline that is then removed,
        so a SentencePiece-style tokenizer adds no start-of-text prefix space."""
        tokenizer = self._plain if as_text else self._backend
        after_newline = tokenizer.encode("\n" + piece, add_special_tokens=False)
        n = len(self._newline_ids)
        if after_newline.ids[:n] == self._newline_ids:
            encoding = after_newline
            ids = after_newline.ids[n:]
        else:
            encoding = tokenizer.encode(piece, add_special_tokens=False)
            ids = encoding.ids
        if as_text:
            self._check_plain(encoding)
        return ids

    def _check_plain(self, encoding: Encoding) -> None:
        ids = encoding.ids
        found = self.control_ids.intersection(ids)
        if not found:
            return
        # Counted in C: a BOS the post-processor adds is the usual, allowed, control id.
        num_added = sum(1 for t in compress(ids, encoding.special_tokens_mask) if t in found)
        if sum(ids.count(t) for t in found) == num_added:
            return
        for token_id, added in zip(ids, encoding.special_tokens_mask, strict=True):
            if token_id in self.control_ids and not added:
                token = self.tokenizer.convert_ids_to_tokens(token_id)
                raise UnsafePromptError(
                    f"this tokenizer spells the control token {token!r} from plain text"
                )


class _Marks:
    """Wraps control-token text in client strings (values and keys, at any depth) in marks."""

    def __init__(self, control_re: re.Pattern[str]):
        self._control_re = control_re
        self.num_marked = 0

    def apply(self, obj: Any) -> Any:
        if isinstance(obj, str):
            return self._mark(obj)
        if isinstance(obj, dict):
            return {self.apply(k): self.apply(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [self.apply(v) for v in obj]
        return obj

    def _mark(self, text: str) -> str:
        if MARK_START in text or MARK_END in text:
            text = text.replace(MARK_START, "").replace(MARK_END, "")
        marked, n = self._control_re.subn(f"{MARK_START}\\g<0>{MARK_END}", text)
        self.num_marked += n
        return marked


def _without_added_tokens(backend: Tokenizer) -> Tokenizer:
    """A copy of `backend` that matches no control token: its normalizer, pre-tokenizer, model
    and post-processor, so plain text tokenizes as the model's vocabulary spells it. Whitespace
    added tokens stay: they are text (some vocabularies spell newlines only that way)."""
    spec = json.loads(backend.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if not t["content"].strip()]
    spec["truncation"] = None
    spec["padding"] = None
    return Tokenizer.from_str(json.dumps(spec))


# The rule as `/v1/server_info` states it ("tokenization").
TOKENIZATION_RULES = {
    "client_text": (
        "encoded as text: message content and text parts, names, tool calls and their "
        "arguments, tool results, reasoning, tool definitions and template kwargs never "
        "become control ids, whatever they spell"
    ),
    "control_ids": (
        "special and added-token ids (such as <|im_start|>, <tool_call>, <think>) come only "
        "from the chat template's own markers"
    ),
    "text_prompts": (
        "a string prompt is client text: the tokenizer adds its own special tokens (a BOS), "
        "the text itself never becomes control ids"
    ),
    "token_id_prompts": "taken as given, checked against the vocabulary; nothing is added",
    "unsafe_template": (
        "400 invalid_request when a chat template escapes client text that spells a control "
        "token, so that it cannot be kept as text"
    ),
}
