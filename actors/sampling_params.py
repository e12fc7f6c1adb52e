"""Per-request sampling parameters (vLLM-like names), validated at construction."""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from numbers import Integral, Real
from typing import Any

MAX_LOGPROBS = 20
_INT_FIELDS = ("n", "max_tokens", "min_tokens", "top_k", "seed", "logprobs", "prompt_logprobs")
_OPTIONAL_FIELDS = ("seed", "logprobs", "prompt_logprobs")
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


@dataclass(frozen=True, init=False)
class SamplingParams:
    # Independent samples of the same prompt; they share the prompt's KV blocks.
    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    # 0 or -1 disables top-k.
    top_k: int = 0
    min_p: float = 0.0
    # HF-style: >1 discourages tokens already in prompt or output.
    repetition_penalty: float = 1.0
    # OpenAI-style, on output tokens only.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Same seed => same tokens regardless of batch mates (CPU fp32).
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    # None: no logprobs; k >= 0: the chosen token's logprob plus the top-k.
    logprobs: int | None = None
    # None: none; k >= 0: each prompt token's logprob (the first has none) plus the top-k.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __init__(self, **kwargs: Any) -> None:
        # `extra` is accepted too: dataclasses.replace() passes every field.
        names = {f.name for f in fields(self)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        for f in fields(self):
            if f.name in kwargs:
                value = kwargs[f.name]
            elif f.default is not MISSING:
                value = f.default
            else:
                value = f.default_factory()  # type: ignore[misc]
            object.__setattr__(self, f.name, value)
        self._check_types()
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids or ()))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _check_types(self) -> None:
        """Wrong types fail naming the field (not as a TypeError from a comparison)."""
        for name in _INT_FIELDS + _FLOAT_FIELDS:
            value = getattr(self, name)
            if value is None and name in _OPTIONAL_FIELDS:
                continue
            kind = Integral if name in _INT_FIELDS else Real
            # NOTE: an infinite temperature or penalty turns -inf (masked) logits into NaN.
            if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value):
                noun = "an integer" if kind is Integral else "a finite number"
                raise ValueError(f"{name} must be {noun} (got {value!r})")
        if not isinstance(self.stop, str | list | tuple | None):
            raise ValueError(f"stop must be a string or a list of strings (got {self.stop!r})")
        ids = self.stop_token_ids
        if not isinstance(ids, list | tuple | None) or not all(
            isinstance(t, Integral) and not isinstance(t, bool) for t in ids or ()
        ):
            raise ValueError(f"stop_token_ids must be a list of integers (got {ids!r})")

    def _validate(self) -> None:
        checks = [
            (self.n >= 1, "n", "must be >= 1"),
            (self.max_tokens >= 1, "max_tokens", "must be >= 1"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens", "must be in [0, max_tokens]"),
            (self.temperature >= 0.0, "temperature", "must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (self.top_k >= 0, "top_k", "must be >= 0 (or -1 to disable)"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (self.seed is None or self.seed >= 0, "seed", "must be >= 0"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be >= 0"),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                "logprobs",
                f"must be in [0, {MAX_LOGPROBS}]",
            ),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                "prompt_logprobs",
                f"must be in [0, {MAX_LOGPROBS}]",
            ),
        ]
        for ok, name, message in checks:
            if not ok:
                raise ValueError(f"{name} {message} (got {getattr(self, name)!r})")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def needs_top_filter(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0
