"""Acceptance: which of a verified draft's tokens the step commits."""

from __future__ import annotations


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
