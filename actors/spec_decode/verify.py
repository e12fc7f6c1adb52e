"""Verification: which of a step's drafted tokens it commits. The acceptance rules
(`accept_draft`, `accept_sampled`) and the `Verifier` that samples a verifying step's positions
and applies them."""

from __future__ import annotations

from collections.abc import Callable

import torch

from actors.messages import ScheduledItem, StepOutput
from actors.sampler import NO_TOKEN, Sampler, SeqSamplingState, race, token_logprobs
from actors.spec_decode.draft import Draft, stream_generator

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


class Verifier:
    """Samples a step in which items verify drafts (rank 0). Each drafted position is sampled
    as ordinary decode would have sampled it (same penalties, bans and grammar row for the
    tokens before it); an item commits what `accept_draft` keeps, or `accept_sampled` where a
    model drafted it for a sampled request. Holds each such draft's distribution q from
    `keep` until the step that verifies it (or `forget`)."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        self.drafts: dict[str, Draft] = {}

    def keep(self, seq_ids: list[str], drafts: list[Draft]) -> None:
        for seq_id, draft in zip(seq_ids, drafts, strict=True):
            self.drafts[seq_id] = draft

    def forget(self, seq_id: str) -> None:
        self.drafts.pop(seq_id, None)

    def sample(
        self,
        sampled: list[ScheduledItem],
        states: dict[str, SeqSamplingState],
        logits: torch.Tensor,  # (sum of 1 + num_draft over `sampled`, vocab); written into
        bitmask: torch.Tensor | None,
        mask_rows: list[int] | None,
    ) -> StepOutput:
        """The tokens (and logprobs) each item commits; `logits` has one row per position."""
        row_states = _position_states(sampled, states)
        # Model drafts of sampled requests verify against the draft's distribution; their
        # target distributions are taken before the sampler below writes into the logits.
        against_q = self._target_distributions(sampled, row_states, logits, bitmask, mask_rows)
        tokens, logprobs = self.sampler(logits, row_states, bitmask, mask_rows, writable=True)
        out = StepOutput([], [] if logprobs is not None else None)
        row = 0
        for j, item in enumerate(sampled):
            width = 1 + item.num_draft
            kept = tokens[row : row + width]
            kept_logprobs = logprobs[row : row + width] if logprobs is not None else None
            if item.num_draft:
                state = states[item.seq_id]
                draft = item.token_ids[-item.num_draft :]
                if j in against_q:
                    kept, kept_logprobs = self._verify_sampled(
                        state, draft, kept, kept_logprobs, *against_q[j]
                    )
                else:
                    kept = accept_draft(draft, kept)
                state.output_token_ids.extend(t for t in kept if t != NO_TOKEN)
            out.sampled_token_ids.append(kept[0])
            if len(kept) > 1:
                out.more_token_ids[j] = kept[1:]
            if kept_logprobs is not None:
                out.logprobs.append(kept_logprobs[0])  # type: ignore[union-attr]
                if len(kept) > 1:
                    out.more_logprobs[j] = kept_logprobs[1 : len(kept)]
            row += width
        return out

    def _target_distributions(
        self,
        sampled: list[ScheduledItem],
        row_states: list[SeqSamplingState],
        logits: torch.Tensor,
        bitmask: torch.Tensor | None,
        mask_rows: list[int] | None,
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """For each sampled item verifying a model's draft of a sampled request: (the draft's
        q rows, the target's p rows, the raw logprob rows or None) at its drafted positions."""
        picked: list[tuple[int, Draft, int]] = []
        row = 0
        for j, item in enumerate(sampled):
            if item.num_draft:
                kept = self.drafts.pop(item.seq_id, None)
                draft = item.token_ids[-item.num_draft :]
                if kept is not None and kept.probs is not None:
                    # The scheduler may have cut the draft, never changed it.
                    assert kept.token_ids[: item.num_draft] == draft
                    picked.append((j, kept, row))
            row += 1 + item.num_draft
        if not picked:
            return {}
        index = [r + t for j, _, r in picked for t in range(sampled[j].num_draft)]
        sub_mask, sub_rows = None, None
        if bitmask is not None and mask_rows:
            masked = set(mask_rows)
            sub_mask = bitmask[index]
            sub_rows = [i for i, r in enumerate(index) if r in masked]
        p, raw = self.sampler.distribution(
            logits[index], [row_states[i] for i in index], sub_mask, sub_rows
        )
        out = {}
        at = 0
        for j, kept, _ in picked:
            n = sampled[j].num_draft
            out[j] = (kept.probs[:n], p[at : at + n], None if raw is None else raw[at : at + n])
            at += n
        return out

    def _verify_sampled(
        self,
        state: SeqSamplingState,
        draft: list[int],
        race_tokens: list[int],
        race_logprobs: list | None,
        q: torch.Tensor,
        p: torch.Tensor,
        raw: torch.Tensor | None,
    ) -> tuple[list[int], list | None]:
        """`accept_sampled` at the sequence's next positions, with each committed token's
        logprobs (from its own row; the bonus token's are the sampler's)."""
        start = len(state.output_token_ids)

        def generator_for(stream: int, i: int) -> torch.Generator:
            if state.seed is None:
                return self.sampler.generator
            return stream_generator(state.seed, stream, start + i)

        kept = accept_sampled(draft, q, p, race_tokens, generator_for)
        if race_logprobs is None:
            return kept, None
        top = state.params.logprobs
        lps = [
            token_logprobs(raw[i], t, top) if raw is not None and t != NO_TOKEN else None
            for i, t in enumerate(kept[: len(draft)])
        ]
        if len(kept) > len(draft):
            lps.append(race_logprobs[len(draft)])
        return kept, lps


def _position_states(
    sampled: list[ScheduledItem], states: dict[str, SeqSamplingState]
) -> list[SeqSamplingState]:
    """One sampling state per logits row: a drafted position's sees the tokens before it as
    output (a copy: only what acceptance keeps reaches the sequence's own state)."""
    row_states: list[SeqSamplingState] = []
    for item in sampled:
        state = states[item.seq_id]
        if not item.num_draft:
            row_states.append(state)
            continue
        draft = item.token_ids[-item.num_draft :]
        for j in range(item.num_draft + 1):
            seen = state.output_token_ids + draft[:j]
            row_states.append(
                SeqSamplingState(state.params, state.prompt_token_ids, seen, state.seed)
            )
    return row_states
