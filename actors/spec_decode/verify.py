"""Acceptance: which of a verified draft's tokens the step commits."""

from __future__ import annotations

from collections.abc import Callable

import torch

from actors.sampler import NO_TOKEN, race

ACCEPT_STREAM, RESIDUAL_STREAM = 2, 3  # see actors/spec_decode/draft.py


def accept_draft(draft: list[int], targets: list[int]) -> list[int]:
    """The longest prefix of `draft` the target agrees with, then the target's own token at the
    first disagreement (or after the whole draft: the bonus token). `targets[j]` is the token
    ordinary decode would draw after the base token and `draft[:j]`: its argmax when greedy;
    when sampling, the winner of the exponential race with the noise ordinary decode would
    use at that position (the sampler's per-position streams).

    For a point-mass draft (a proposer that names tokens without probabilities, as prompt
    lookup does) this is rejection sampling exactly: the race picks `draft[j]` with
    probability p(draft[j]) = min(1, p/q), and given that it does not, a token from p with
    `draft[j]` removed and renormalised (the residual max(0, p - q)). So the committed tokens
    have the target's distribution, and a seeded request commits what it would have without
    speculation, token for token."""
    accepted = 0
    while accepted < len(draft) and targets[accepted] == draft[accepted]:
        accepted += 1
    return targets[: accepted + 1]


def accept_sampled(
    draft: list[int],
    q: torch.Tensor,
    p: torch.Tensor,
    targets: list[int],
    generator_for: Callable[[int, int], torch.Generator],
) -> list[int]:
    """Rejection sampling of a draft drawn from q ((len(draft), vocab)) against the target's
    p at the same positions: `draft[i]` is kept with probability min(1, p/q); the first one
    that is not is replaced by a draw from the residual max(0, p - q), renormalised, and ends
    the run; after a fully kept draft, the target's own draw at the next position (`targets[-1]`,
    the bonus token). The committed tokens have the target's distribution whatever q is.

    `targets[i]` is ordinary decode's draw at position i (NO_TOKEN where the grammar admits
    nothing: the run ends there); `generator_for(stream, i)` gives the generator of the
    uniform (ACCEPT_STREAM) or residual (RESIDUAL_STREAM) draw at position i."""
    kept: list[int] = []
    for i, d in enumerate(draft):
        if targets[i] == NO_TOKEN:
            return kept + [NO_TOKEN]
        u = float(torch.rand((), generator=generator_for(ACCEPT_STREAM, i)))
        if u * float(q[i, d]) < float(p[i, d]):
            kept.append(d)
            continue
        residual = (p[i] - q[i]).clamp_(min=0)
        if not float(residual.sum()) > 0:  # q >= p everywhere: only when they are equal
            residual = p[i]
        return kept + [race(residual, generator_for(RESIDUAL_STREAM, i))]
    return kept + [targets[len(draft)]]
