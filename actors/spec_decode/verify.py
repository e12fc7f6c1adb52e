"""Acceptance: which of a verified draft's tokens the step commits."""

from __future__ import annotations


def accept_greedy(draft: list[int], targets: list[int]) -> list[int]:
    """Greedy verification: the longest prefix of `draft` the target model agrees with, then
    its own token at the first disagreement (or after the whole draft: the bonus token).
    `targets[j]` is the target's token after the base token and `draft[:j]`, so the result is
    exactly what `len(result)` ordinary decode steps would have produced."""
    accepted = 0
    while accepted < len(draft) and targets[accepted] == draft[accepted]:
        accepted += 1
    return targets[: accepted + 1]
