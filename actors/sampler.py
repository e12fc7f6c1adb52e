"""Batched sampling: penalties, masks, temperature, top-k/top-p/min-p, seeded draws, logprobs.

Draws use the exponential race (argmax p / E, E ~ Exp(1)), which samples exactly from p and
lets a seeded sequence take its noise from its own stream: the noise of output position t comes
from a generator seeded by (seed, t), so the same seed gives the same tokens whatever else shares
the batch, however often the sequence was preempted, and whether or not a verified draft covered
position t (speculation samples each position with the noise ordinary decode would have used).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from actors.messages import TokenLogprobs
from actors.sampling_params import SamplingParams

NO_TOKEN = -1  # every token was masked out: the constraint admits nothing more
# What `serve_app::argmax_rows` reads.
_ARGMAX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class SeqSamplingState:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None  # the request's; None draws from the sampler's shared generator


class Sampler:
    def __init__(
        self,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        seed: int = 0,
        cpu_kernels: bool = False,
    ):
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.generator = torch.Generator().manual_seed(seed)
        # The engine's CPU kernels (platform.cpu_sampler_kernels): a greedy batch's argmax in
        # one vectorized read of each row (`serve_app::argmax_rows`, torch.argmax's answer);
        # a forbidden winner's row re-picked in one read of the row (`masked_argmax`) instead
        # of masking it in place, then argmax, then the all-masked check; rows that need the
        # masked distribution masked by `apply_bitmask` instead of torch's unpacking.
        self.cpu_kernels = cpu_kernels

    def __call__(
        self,
        logits: torch.Tensor,  # (num_seqs, vocab)
        states: list[SeqSamplingState],
        bitmask: torch.Tensor | None = None,
        bitmask_rows: list[int] | None = None,
        writable: bool = False,
    ) -> tuple[list[int], list[TokenLogprobs | None] | None]:
        """One token per row (NO_TOKEN where the mask admits nothing). With `writable`, the
        caller's logits may be written in place (they are its scratch: no copy is made)."""
        if _plain_greedy(states, bitmask_rows if bitmask is not None else None):
            # Nothing to mask, penalise or report: the argmax of the logits as they are (no
            # fp32 copy of a batch x vocab tensor, no all-masked check).
            token_list = self.argmax(logits).tolist()
            for t, s in zip(token_list, states, strict=True):
                s.output_token_ids.append(t)
            return token_list, None
        # Penalties, bans and masks below write in place: into a copy unless the caller's
        # tensor is scratch (a batch x vocab copy is ~2 ms at 64 x 49k).
        logits = logits.to(device="cpu", dtype=torch.float32, copy=not writable)
        want_logprobs = any(s.params.logprobs is not None for s in states)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        self._apply_penalties(logits, states)
        self._ban_stops_before_min_tokens(logits, states)
        masked = bitmask_rows if bitmask is not None and bitmask_rows else []
        # A top-k/top-p/min-p filter sees the masked distribution: mask those rows first.
        filtered = [r for r in masked if states[r].params.needs_top_filter]
        dead = []
        if filtered:
            _apply_mask(logits, bitmask, filtered, self.cpu_kernels)
            dead = _all_masked(logits, filtered)
        scores = self._scores(logits, states)
        tokens = self.argmax(scores)
        # The other constrained rows keep the unmasked winner when their grammar allows it:
        # masking only lowers other tokens' scores to -inf, so the masked winner (with the
        # same noise) is the same token. Only rows whose winner is forbidden are masked.
        late = [r for r in masked if not states[r].params.needs_top_filter]
        if late:
            winners = tokens[late]
            words = bitmask[late].gather(1, (winners >> 5).unsqueeze(1)).squeeze(1)
            allowed = ((words >> (winners & 31).to(torch.int32)) & 1).bool()
            refill = [r for r, ok in zip(late, allowed.tolist(), strict=True) if not ok]
            if refill and self.cpu_kernels and scores.is_cpu and bitmask.is_cpu:
                picked = torch.ops.serve_app.masked_argmax(scores, bitmask, torch.tensor(refill))
                tokens[refill] = picked
                dead += [r for r, t in zip(refill, picked.tolist(), strict=True) if t < 0]
            elif refill:
                _apply_mask(scores, bitmask, refill, self.cpu_kernels)
                tokens[refill] = scores[refill].argmax(dim=-1)
                dead += _all_masked(scores, refill)
        # The constraint admits nothing more.
        tokens[dead] = NO_TOKEN
        token_list = tokens.tolist()
        logprobs = None
        if raw_logprobs is not None:
            logprobs = [
                _token_logprobs(raw_logprobs[i], t, s.params.logprobs)
                if s.params.logprobs is not None and t != NO_TOKEN
                else None
                for i, (t, s) in enumerate(zip(token_list, states, strict=True))
            ]
        for t, s in zip(token_list, states, strict=True):
            if t != NO_TOKEN:
                s.output_token_ids.append(t)
        return token_list, logprobs

    def distribution(
        self,
        logits: torch.Tensor,
        states: list[SeqSamplingState],
        bitmask: torch.Tensor | None = None,
        bitmask_rows: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per (sampled, never greedy) row, the probabilities its token is drawn from — the
        ones `__call__` races over: penalties, min-token bans, the grammar mask, temperature,
        top-k/top-p/min-p — and the raw logprobs (before any of them) when a row reports
        logprobs. `logits` is not written."""
        logits = logits.to(device="cpu", dtype=torch.float32, copy=True)
        want_logprobs = any(s.params.logprobs is not None for s in states)
        raw = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        self._apply_penalties(logits, states)
        self._ban_stops_before_min_tokens(logits, states)
        if bitmask is not None and bitmask_rows:
            _apply_mask(logits, bitmask, bitmask_rows, self.cpu_kernels)
        return _filtered_probs(logits, states), raw

    def _apply_penalties(self, logits: torch.Tensor, states: list[SeqSamplingState]) -> None:
        for i, s in enumerate(states):
            p = s.params
            if not p.needs_penalties:
                continue
            row = logits[i]
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(s.prompt_token_ids) | set(s.output_token_ids)))
                if seen.numel():
                    vals = row[seen]
                    row[seen] = torch.where(
                        vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
                    )
            if (p.presence_penalty or p.frequency_penalty) and s.output_token_ids:
                counts = torch.bincount(torch.tensor(s.output_token_ids), minlength=row.shape[0])[
                    : row.shape[0]
                ].float()
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()

    def _ban_stops_before_min_tokens(
        self, logits: torch.Tensor, states: list[SeqSamplingState]
    ) -> None:
        for i, s in enumerate(states):
            p = s.params
            if len(s.output_token_ids) < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)
                if banned:
                    logits[i, banned] = float("-inf")

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """torch.argmax over each row, through `argmax_rows` where it can take the tensor."""
        if (
            self.cpu_kernels
            and x.is_cpu
            and x.dtype in _ARGMAX_DTYPES
            and x.dim() == 2
            and x.shape[1] > 0
            and x.stride(1) == 1
        ):
            return torch.ops.serve_app.argmax_rows(x)
        return x.argmax(dim=-1)

    def _scores(self, logits: torch.Tensor, states: list[SeqSamplingState]) -> torch.Tensor:
        """Per row, the scores whose argmax is its token: the logits of a greedy row; p / E
        (E ~ Exp(1)) of a sampled one (-inf where p is 0, so a masked token never wins)."""
        if all(s.params.is_greedy for s in states):
            return logits
        greedy = torch.tensor([s.params.is_greedy for s in states])
        probs = _filtered_probs(logits, states)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, s in enumerate(states):
            if s.seed is not None:
                position = position_generator(s.seed, len(s.output_token_ids))
                noise[i].exponential_(generator=position)
        drawn = (probs / noise).masked_fill_(probs == 0, float("-inf"))
        return torch.where(greedy.unsqueeze(1), logits, drawn)


def _filtered_probs(logits: torch.Tensor, states: list[SeqSamplingState]) -> torch.Tensor:
    """Softmax of the logits at each row's temperature (1 for a greedy row), after its
    top-k/top-p/min-p filter."""
    temps = torch.tensor([1.0 if s.params.is_greedy else s.params.temperature for s in states])
    scaled = logits / temps.unsqueeze(1)
    if any(s.params.needs_top_filter for s in states):
        scaled = _top_filter(scaled, states)
    return torch.softmax(scaled, dim=-1)


def race(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from `probs` (a row; zeros never win) by the exponential race."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).masked_fill_(probs == 0, float("-inf")).argmax())


def token_logprobs(raw_row: torch.Tensor, token: int, k: int | None) -> TokenLogprobs | None:
    """A committed token's logprobs (rank, top-k) from its row's raw logprobs; None when the
    request asked for none."""
    return None if k is None else _token_logprobs(raw_row, token, k)


_MASK64 = (1 << 64) - 1


def position_generator(seed: int, position: int) -> torch.Generator:
    """The generator of output position `position` of a request seeded `seed`: splitmix64 of
    the pair, so neighbouring seeds and positions give unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return torch.Generator().manual_seed((z ^ (z >> 31)) & 0x7FFF_FFFF_FFFF_FFFF)


def _all_masked(scores: torch.Tensor, rows: list[int]) -> list[int]:
    """Those of `rows` where every token is -inf."""
    dead = torch.isneginf(scores[rows]).all(dim=-1).tolist()
    return [r for r, d in zip(rows, dead, strict=True) if d]


def _apply_mask(scores: torch.Tensor, bitmask: torch.Tensor, rows: list[int], kernel: bool) -> None:
    """-inf wherever row r of `bitmask` forbids a token, for each r in `rows` (in place); tokens
    past the bitmask's width stay allowed. The engine's own kernel where built, else torch:
    where the vocab is not a multiple of 32, xgrammar's CPU mask can write one -inf past the
    row (seen at the last word's first forbidden bit beyond the vocab, when the word's tokens
    inside the vocab were all allowed): into the next row, or the heap after the last one."""
    if kernel and scores.is_cpu and bitmask.is_cpu:
        torch.ops.serve_app.apply_bitmask(scores, bitmask, torch.tensor(rows))
        return
    index = torch.tensor(rows)
    covered = min(scores.shape[1], bitmask.shape[1] * 32)
    bits = (bitmask[index].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    forbidden = bits.flatten(1)[:, :covered] == 0
    scores[index, :covered] = scores[index, :covered].masked_fill(forbidden, float("-inf"))


def _plain_greedy(states: list[SeqSamplingState], bitmask_rows: list[int] | None) -> bool:
    return not bitmask_rows and all(
        s.params.is_greedy
        and not s.params.needs_penalties
        and s.params.logprobs is None
        and len(s.output_token_ids) >= s.params.min_tokens
        for s in states
    )


def _top_filter(logits: torch.Tensor, states: list[SeqSamplingState]) -> torch.Tensor:
    vocab = logits.shape[-1]
    top_k = torch.tensor([s.params.top_k or vocab for s in states]).clamp(max=vocab)
    top_p = torch.tensor([s.params.top_p for s in states])
    min_p = torch.tensor([s.params.min_p for s in states])
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab).unsqueeze(0)
    drop = ranks >= top_k.unsqueeze(1)
    # top-p and min-p see the top-k survivors renormalised (HF warpers' and vLLM's order).
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # Drop a token when the mass before it already reaches top_p (the first always stays).
    # NOTE: only rows with top_p < 1: fp32 cumsums reach 1.0 early, which would cut the tail of
    # an unfiltered row whenever a batch mate needs this filter.
    drop |= ((probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    drop |= probs < min_p.unsqueeze(1) * probs[:, :1]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _token_logprobs(row: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    chosen = float(row[token])
    rank = int((row > chosen).sum()) + 1
    top: list[tuple[int, float]] = []
    if k:
        values, ids = row.topk(k)
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprobs(logprob=chosen, rank=rank, top=top)
