"""How many tokens a request may generate: one decision for every API family and batch.

The effective output budget is the requested value when the client gave one, checked against
every cap that applies (the server's `limits.max_output_tokens`, the API key's, a generation
profile's) and against the room its prompt leaves in the model's context; otherwise the
family's default, lowered to every cap and to the room the longest prompt leaves. A refusal
names the limit that fired. Called once per request, after tokenization and before anything
is reserved or allocated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from serve_app import errors

Cap = tuple[str, int | None]  # (the limit, as a message names it; its bound or None)


@dataclass(frozen=True)
class BudgetRules:
    """How a family words and classes a refusal (its API's contract)."""

    param: str = "max_tokens"  # the field the client sets
    status: int = 400  # OpenAI endpoints: 400; /v1/generations: 422
    # A requested budget the context cannot hold: OpenAI answers max_tokens_exceeded, the
    # generations API context_length_exceeded on its input.
    overflow_code: str = "max_tokens_exceeded"
    overflow_param: str | None = None


OPENAI_RULES = BudgetRules()


def server_and_key_caps(server_cap: int | None, key_cap: int | None) -> list[Cap]:
    return [
        ("the server's limit max_output_tokens", server_cap),
        ("the API key's limit max_output_tokens", key_cap),
    ]


def output_budget(
    requested: int | None,
    *,
    default: int | None,
    caps: Sequence[Cap],
    context: int,
    prompt_lengths: Sequence[int],
    prompt_param: str,
    rules: BudgetRules = OPENAI_RULES,
) -> int:
    """The output budget of each choice, or an APIError naming the limit that refuses it."""
    for name, bound in caps:
        if requested is not None and bound is not None and requested > bound:
            raise errors.max_tokens_exceeded(
                f"{rules.param} is {requested}; {name} allows at most {bound}.",
                status=rules.status,
                param=rules.param,
            )
    longest = max(prompt_lengths, default=0)
    if longest >= context:
        raise errors.context_length_exceeded(
            f"This model's maximum context length is {context} tokens; the {prompt_param} has "
            f"{longest} tokens, leaving no room for output.",
            status=rules.status,
            param=prompt_param,
        )
    if requested is None:
        bounds = [b for _, b in caps if b is not None]
        return min([context - longest, *bounds, *([default] if default is not None else [])])
    if longest + requested > context:
        message = (
            f"This model's maximum context length is {context} tokens. However, you requested "
            f"{longest + requested} tokens ({longest} in the {prompt_param}, {requested} in the "
            "output)."
        )
        if rules.overflow_code == "context_length_exceeded":
            raise errors.context_length_exceeded(
                message, status=rules.status, param=rules.overflow_param or prompt_param
            )
        raise errors.max_tokens_exceeded(message, status=rules.status, param=rules.param)
    return requested
