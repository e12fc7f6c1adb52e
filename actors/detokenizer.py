"""Incremental, UTF-8-safe detokenization with stop strings.

Text is decoded over a short window of earlier tokens, so a character whose bytes span several
tokens appears only once complete (a trailing U+FFFD means "wait"). Text that could be the
start of a stop string is held back until the next tokens decide it.
"""

from __future__ import annotations

from tokenizers import Tokenizer

from actors.sampling_params import SamplingParams

# Tokens before the read offset decoded again for context (byte-level merges look back).
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, num_prompt_tokens: int, params: SamplingParams):
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stops = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in self.stops), default=0)
        self.prefix_offset = max(num_prompt_tokens - _CONTEXT_TOKENS, 0)
        self.read_offset = num_prompt_tokens
        self.text = ""
        self.num_emitted = 0

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, token_ids: list[int], check_stops: bool = True) -> str | None:
        """Decode up to the end of `token_ids`; returns the stop string it completes, if any."""
        prefix = self._decode(token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(token_ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        search_from = max(len(self.text) - self.max_stop_len + 1, 0)
        self.text += full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        if not self.stops or not check_stops:
            return None
        found: tuple[int, str] | None = None
        for stop in self.stops:
            idx = self.text.find(stop, search_from)
            if idx != -1 and (found is None or idx < found[0]):
                found = (idx, stop)
        if found is None:
            return None
        idx, stop = found
        self.text = self.text[: idx + (len(stop) if self.include_stop else 0)]
        return stop

    def take_delta(self, final: bool) -> str:
        """New text safe to show; when `final`, everything left (nothing can match later)."""
        end = len(self.text) if final else len(self.text) - self._holdback()
        end = max(end, self.num_emitted)
        delta = self.text[self.num_emitted : end]
        self.num_emitted = end
        return delta

    def _holdback(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        for k in range(min(self.max_stop_len - 1, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(stop.startswith(tail) for stop in self.stops):
                return k
        return 0
