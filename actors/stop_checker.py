"""When a sequence stops, in the order the checks apply after each new token."""

from __future__ import annotations

from actors.config import ModelConfig
from actors.detokenizer import IncrementalDetokenizer
from actors.request import FinishReason, Sequence


def check_stop(
    seq: Sequence, token: int, model: ModelConfig, detok: IncrementalDetokenizer
) -> tuple[FinishReason | None, str | int | None]:
    params = seq.params
    # Stops apply once min_tokens are out (the sampler bans stop tokens before that).
    past_min = seq.num_output_tokens >= params.min_tokens
    if past_min and not params.ignore_eos and token in model.eos_token_ids:
        return FinishReason.STOP, None
    if past_min and token in params.stop_token_ids:
        if params.include_stop_str_in_output:
            detok.update(seq.token_ids, check_stops=False)
        return FinishReason.STOP, token
    stop = detok.update(seq.token_ids, check_stops=past_min)
    if stop is not None:
        return FinishReason.STOP, stop
    if seq.constraint is not None and seq.constraint.is_terminated():
        return FinishReason.STOP, "grammar_end"
    if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= model.max_model_len:
        return FinishReason.LENGTH, None
    return None, None
