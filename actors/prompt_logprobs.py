"""Prompt logprobs: how likely the model found each prompt token, given the tokens before it.

Position p's logits score the prompt token at p + 1, so a prefill chunk covering positions
[start, end) reports prompt indices start + 1 .. min(end, P - 1) (P prompt tokens): chunks of
one prompt cover every index once, and index 0 has none. Only chunks whose item asks pay for
the full-vocab LM head and log-softmax over their prompt positions; every other step keeps the
one logits row per sampled sequence.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from actors.messages import PromptLogprobsChunk, ScheduledItem, TokenLogprobs

# Prompt positions scored per LM-head call: bounds the (rows, vocab) fp32 temporaries.
_ROWS_PER_SLICE = 256


def prompt_positions(item: ScheduledItem, num_prompt_tokens: int) -> range:
    """Positions of this chunk whose logits score a prompt token (the one after them)."""
    end = min(item.start_pos + len(item.token_ids), num_prompt_tokens - 1)
    return range(item.start_pos, max(end, item.start_pos))


def compute_prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,  # (num_tokens, hidden) of the whole step
    items: list[ScheduledItem],
    row_starts: list[int],
    prompts: dict[str, list[int]],
    is_driver: bool,
) -> list[PromptLogprobsChunk]:
    """The prompt logprobs of every item that asks. Every rank must call this with the same
    step: the LM head gathers vocab shards across ranks; only the driver builds results."""
    chunks = []
    for item, row_start in zip(items, row_starts, strict=True):
        if item.prompt_logprobs is None:
            continue
        prompt = prompts[item.seq_id]
        positions = prompt_positions(item, len(prompt))
        if not positions:
            continue
        entries: list[TokenLogprobs] = []
        for lo in range(0, len(positions), _ROWS_PER_SLICE):
            span = positions[lo : lo + _ROWS_PER_SLICE]
            first_row = row_start + span.start - item.start_pos
            rows = hidden.narrow(0, first_row, len(span))
            logits = compute_logits(rows)
            if is_driver:
                targets = prompt[span.start + 1 : span.stop + 1]
                entries += _score(logits, targets, item.prompt_logprobs)
        if is_driver:
            chunks.append(PromptLogprobsChunk(item.seq_id, positions.start + 1, entries))
    return chunks


def _score(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprobs]:
    """Each row's log-softmax at its target token, the target's rank, and the top-k."""
    # (rows, vocab) in fp32, as the sampler's logprobs of generated tokens.
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    target_ids = torch.tensor(targets, dtype=torch.long, device=logprobs.device).unsqueeze(1)
    chosen = logprobs.gather(1, target_ids)  # (rows, 1)
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    chosen_list = chosen.squeeze(1).cpu().tolist()
    rank_list = ranks.cpu().tolist()
    if k:
        values, ids = logprobs.topk(k, dim=-1)
        tops = [
            list(zip(i, v, strict=True))
            for i, v in zip(ids.cpu().tolist(), values.cpu().tolist(), strict=True)
        ]
    else:
        tops = [[] for _ in targets]
    return [
        TokenLogprobs(logprob=lp, rank=rank, top=top)
        for lp, rank, top in zip(chosen_list, rank_list, tops, strict=True)
    ]
