"""The speculation config, with vLLM's names: `{"method": ..., "num_speculative_tokens": k}`."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

# ngram: prompt lookup, no model. draft_model: a second checkpoint with the target's
# tokenizer (`model`). self_draft: the target's first `num_draft_layers` layers and its head.
METHODS = ("ngram", "draft_model", "self_draft")
MODEL_METHODS = ("draft_model", "self_draft")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    # Proposed tokens per sequence and step (k): each verifying sequence takes 1 + k positions.
    num_speculative_tokens: int = 4
    # Prompt lookup: the longest suffix of the sequence (at most `prompt_lookup_max` tokens, at
    # least `prompt_lookup_min`) that occurred earlier proposes the tokens that followed it.
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    # Back-off: a sequence whose acceptance rate over its last 32 proposed tokens falls below
    # this stops proposing for a while, then probes again (0 turns back-off off).
    min_acceptance_rate: float = 0.3
    # draft_model: the draft checkpoint's folder (vLLM's name). Its vocabulary must be the
    # target's.
    model: str | None = None
    # self_draft: how many of the target's layers (from the first) the draft runs before the
    # target's final norm and head; checked against the target's depth when the engine starts.
    num_draft_layers: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config.method: {self.method!r} is not one of {', '.join(METHODS)}"
            )
        if (self.model is not None) != (self.method == "draft_model"):
            raise ValueError(
                "speculative_config.model: the draft checkpoint is required with method "
                "'draft_model' and taken by no other method"
            )
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ValueError("speculative_config.model: expected a checkpoint folder")
        layers = self.num_draft_layers
        if (layers is not None) != (self.method == "self_draft"):
            raise ValueError(
                "speculative_config.num_draft_layers: required with method 'self_draft' and "
                "taken by no other method"
            )
        if layers is not None and not (
            isinstance(layers, int) and not isinstance(layers, bool) and layers >= 1
        ):
            raise ValueError(
                f"speculative_config.num_draft_layers: {layers!r} must be a positive integer"
            )
        k = self.num_speculative_tokens
        if not (isinstance(k, int) and 1 <= k <= MAX_SPECULATIVE_TOKENS):
            raise ValueError(
                f"speculative_config.num_speculative_tokens: {k!r} must be an integer in "
                f"[1, {MAX_SPECULATIVE_TOKENS}]"
            )
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({lo!r}) and prompt_lookup_max ({hi!r}) "
                "must be integers with 1 <= min <= max"
            )

        rate = self.min_acceptance_rate
        if not (isinstance(rate, (int, float)) and not isinstance(rate, bool) and 0 <= rate <= 1):
            raise ValueError(
                f"speculative_config.min_acceptance_rate: {rate!r} must be a number in [0, 1]"
            )

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """None stays None (no speculation); unknown keys are refused by name."""
        if raw is None or isinstance(raw, SpeculativeConfig):
            return raw
        if not isinstance(raw, dict):
            raise ValueError(f"speculative_config: expected an object, got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown key(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        return cls(**raw)

    @property
    def uses_model(self) -> bool:
        """Whether the drafts come from a model run on the engine's ranks."""
        return self.method in MODEL_METHODS

    def as_dict(self) -> dict[str, Any]:
        """Every key in effect (those of other methods, unset, left out)."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: v for k, v in values.items() if v is not None}
