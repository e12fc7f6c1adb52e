"""Model proposers: a second checkpoint (`draft_model`) or the target's own first layers and
head (`self_draft`) draft `k` tokens per sequence, one batched forward per drafted position.

The draft runs on every rank of the engine, beside the target (`ModelRunner.propose`), over a
paged KV cache of its own that uses the target's block tables: a sequence's committed tokens
have their draft KV in the same block ids as their target KV, so nothing is copied and the
target's block manager stays the only allocator. Positions past the blocks a sequence owns
(the drafted ones) go to scratch blocks past the target's range, reused every round.

A sequence's draft KV is kept across steps: each round feeds only the committed tokens the draft
has not seen (the last one, and those a verification accepted), then drafts. Preemption frees a
sequence's blocks, so a preempted sequence starts over. `self_draft`'s layers are the target's
own, so their KV of committed tokens is the target's: it is copied block by block from the
target's cache (never recomputed), and each round feeds only the last committed token.

Greedy requests draft the draft model's argmax. Sampled ones draw from the draft's own
distribution q (the request's temperature and top-k/top-p/min-p over the draft's logits) and
keep q for verification, which accepts a drafted token d with probability min(1, p(d)/q(d))
and otherwise draws from the residual max(0, p - q) (`Verifier`, verify.py). Seeded requests
draw every one of those from streams of (seed, output position), so a seed repeats its tokens.
Every rank draws the same drafts (their logits are all-gathered and their generators are
seeded alike), so every rank feeds the same tokens.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from actors.config import CacheConfig, ModelConfig
from actors.messages import ScheduledItem
from actors.models.llama import LlamaModel
from actors.sampler import SeqSamplingState, _filtered_probs, position_generator
from actors.spec_decode.config import SpeculativeConfig

# Distinct streams of a seeded request's (seed, position) noise: the target's own draw uses
# the seed as given (actors/sampler.py); these salt it (verification's two: verify.py).
DRAFT_STREAM = 1
_MASK63 = (1 << 63) - 1


def stream_generator(seed: int, stream: int, position: int) -> torch.Generator:
    """The generator of output position `position` for one of a seeded request's streams."""
    return position_generator((seed * 4 + stream) & _MASK63, position)


@dataclass
class DraftRequest:
    """One sequence's ask: its committed tokens, its block table (as the target's block
    manager holds it now) and how many tokens to draft."""

    seq_id: str
    token_ids: list[int]
    block_table: list[int]
    num_preemptions: int
    k: int


@dataclass
class Draft:
    """What the driver keeps until the draft is verified: the tokens, and for a sampled
    request the draft's distribution at each of them ((len(tokens), vocab))."""

    token_ids: list[int]
    probs: torch.Tensor | None


@dataclass
class _SeqDraftState:
    computed: int = 0  # leading committed tokens whose KV the draft cache holds
    num_preemptions: int = 0


class EarlyExit(nn.Module):
    """`self_draft`'s model: the target's embedding, its first `num_layers` decoder layers,
    its final norm and head — the same parameters, not copies — on the draft's own attention
    backend (the layers are shallow clones that differ only in that)."""

    def __init__(self, target: nn.Module, num_layers: int, backend: nn.Module) -> None:
        super().__init__()
        layers = list(target.model.layers[:num_layers])
        memo: dict[int, object] = {}
        for module in target.modules():
            for value in module.__dict__.values():
                if isinstance(value, torch.Tensor):
                    memo[id(value)] = value
            for group in (module._parameters, module._buffers):
                for value in group.values():
                    if value is not None:
                        memo[id(value)] = value
        for layer in layers:
            memo[id(layer.self_attn.rotary)] = layer.self_attn.rotary
            memo[id(layer.self_attn.backend)] = backend
        self.layers = copy.deepcopy(nn.ModuleList(layers), memo)
        self.embed_tokens = target.model.embed_tokens
        self.norm = target.model.norm
        self.lm_head = target.lm_head

    # The decoder's own loop: it reads only embed_tokens, layers and norm, which this has.
    forward = LlamaModel.forward

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def draft_model_config(spec: SpeculativeConfig, target: ModelConfig) -> ModelConfig:
    """The draft's config, checked against the target's: the same vocabulary (ids mean the
    same tokens), room for the target's longest sequence, the target's dtype."""
    if spec.method == "self_draft":
        layers = spec.num_draft_layers
        assert layers is not None
        if layers >= target.num_layers:
            raise ValueError(
                f"speculative_config.num_draft_layers: {layers} must be below the target's "
                f"{target.num_layers} layers"
            )
        return dataclasses.replace(target, num_layers=layers)
    assert spec.model is not None
    draft = ModelConfig.from_pretrained(spec.model, dtype=target.dtype)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config.model: the draft's vocabulary ({draft.vocab_size} tokens, "
            f"{spec.model}) is not the target's ({target.vocab_size}, {target.path})"
        )
    if draft.max_position_embeddings < target.max_model_len:
        raise ValueError(
            f"speculative_config.model: the draft takes {draft.max_position_embeddings} "
            f"positions, fewer than the target's max_model_len ({target.max_model_len})"
        )
    return dataclasses.replace(draft, max_model_len=target.max_model_len)


class DraftRunner:
    """The draft's model and KV cache on one rank (see the module docstring)."""

    def __init__(
        self,
        spec: SpeculativeConfig,
        target_config: ModelConfig,
        cache_config: CacheConfig,
        device: torch.device,
        target_model: nn.Module,
        runner_class: type,
        seed: int = 0,
    ) -> None:
        """`runner_class`: the engine's ModelRunner, which builds and steps the draft's model
        and cache as it does the target's (passed in: it imports this module)."""
        self.spec = spec
        config = draft_model_config(spec, target_config)
        build = None
        if spec.method == "self_draft":
            layers = config.num_layers

            def build(backend):
                return EarlyExit(target_model, layers, backend)

        self.runner = runner_class(config, cache_config, device, seed=seed, build=build)
        # A kept gather is the target's optimisation; the draft reads its cache as it lies.
        self.runner.keep_gathers = False
        self.block_size = cache_config.block_size
        self.scratch_device = device
        self.shared: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        self.scratch: list[int] = []
        self.states: dict[str, _SeqDraftState] = {}
        # Alike on every rank, and consumed alike: every rank draws the same drafts.
        self.generator = torch.Generator().manual_seed(seed + 1)

    @property
    def bytes_per_block(self) -> int:
        return self.runner.bytes_per_block

    def init_kv_cache(
        self, num_blocks: int, target_caches: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        self.num_blocks = num_blocks
        self._allocate(num_blocks, 0)
        self.states.clear()
        # self_draft: the target's caches of the layers it shares, where committed KV is read.
        self.shared = target_caches[: self.runner.config.num_layers]
        if self.spec.method != "self_draft":
            self.shared = []

    def _allocate(self, num_blocks: int, num_scratch: int) -> None:
        self.runner.init_kv_cache(num_blocks + num_scratch)
        self.scratch = list(range(num_blocks, num_blocks + num_scratch))

    def forget(self, seq_id: str) -> None:
        self.states.pop(seq_id, None)

    @torch.inference_mode()
    def propose(
        self, requests: list[DraftRequest], states: dict[str, SeqSamplingState]
    ) -> list[Draft]:
        """Each request's draft: `k` tokens, autoregressively, all requests batched per
        position (the first forward also feeds each sequence's unseen committed tokens)."""
        bs = self.block_size
        tables: list[list[int]] = []
        need = 0
        for r in requests:
            blocks = -(-(len(r.token_ids) + r.k - 1) // bs)
            need += max(0, blocks - len(r.block_table))
        if need > len(self.scratch):
            # More drafting sequences than ever before: room for twice as many blocks (the
            # draft's KV of committed tokens lives in the target's block ids, kept as is).
            self._grow(2 * need)
        free = iter(self.scratch)
        items = []
        copies: list[int] = []
        for r in requests:
            state = self.states.get(r.seq_id)
            if state is None or state.num_preemptions != r.num_preemptions:
                state = self.states[r.seq_id] = _SeqDraftState(0, r.num_preemptions)
            n = len(r.token_ids)
            blocks = -(-(n + r.k - 1) // bs)
            table = list(r.block_table)
            table += [next(free) for _ in range(blocks - len(table))]
            tables.append(table)
            start = min(state.computed, n - 1)
            if self.shared and start < n - 1:
                # The target computed every committed token but the last: take its KV.
                copies.extend(r.block_table[start // bs : (n - 2) // bs + 1])
                start = n - 1
            items.append(ScheduledItem(r.seq_id, r.token_ids[start:n], start, table, True))
            # What lies in blocks the sequence owns stays valid; scratch is reused next round.
            state.computed = min(n, len(r.block_table) * bs)
        if copies:
            index = torch.tensor(copies, device=self.scratch_device)
            for (k, v), (tk, tv) in zip(self.runner.kv_caches, self.shared, strict=True):
                k.index_copy_(1, index, tk.index_select(1, index))
                v.index_copy_(1, index, tv.index_select(1, index))
        drafts = [Draft([], None) for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        live = list(range(len(requests)))
        for j in range(max(r.k for r in requests)):
            if j:
                items = []
                for i in live:
                    r = requests[i]
                    position = len(r.token_ids) + j - 1
                    token = drafts[i].token_ids[-1]
                    items.append(ScheduledItem(r.seq_id, [token], position, tables[i], True))
            logits = self.runner.last_logits(items)
            targets = [states[requests[i].seq_id] for i in live]
            positions = [len(requests[i].token_ids) + j for i in live]
            drawn, qs = self._draw(logits, targets, positions)
            for row, i in enumerate(live):
                drafts[i].token_ids.append(drawn[row])
                if qs[row] is not None:
                    probs[i].append(qs[row])
            live = [i for i in live if requests[i].k > j + 1]
        for draft, rows in zip(drafts, probs, strict=True):
            if rows:
                draft.probs = torch.stack(rows)
        return drafts

    def _draw(
        self, logits: torch.Tensor, targets: list[SeqSamplingState], positions: list[int]
    ) -> tuple[list[int], list[torch.Tensor | None]]:
        """Per row, the token drafted at sequence position `positions[row]`: the argmax for a
        greedy request; else a draw from q (the request's temperature and filters over the
        draft's logits), returned with q."""
        argmax = self.runner.sampler.argmax  # the engine's CPU kernel where it takes the rows
        drawn = argmax(logits).tolist()
        qs: list[torch.Tensor | None] = [None] * len(targets)
        rows = [r for r, t in enumerate(targets) if not t.params.is_greedy]
        if not rows:
            return drawn, qs
        q = _filtered_probs(logits[rows].float(), [targets[r] for r in rows])
        noise = torch.empty_like(q).exponential_(generator=self.generator)
        for at, r in enumerate(rows):
            t = targets[r]
            if t.seed is not None:
                position = positions[r] - len(t.prompt_token_ids)
                noise[at].exponential_(generator=stream_generator(t.seed, DRAFT_STREAM, position))
        winners = argmax((q / noise).masked_fill_(q == 0, float("-inf"))).tolist()
        for at, r in enumerate(rows):
            drawn[r] = winners[at]
            qs[r] = q[at]
        return drawn, qs

    def _grow(self, num_scratch: int) -> None:
        """More scratch blocks: the cache is reallocated with the committed blocks' KV kept."""
        old = self.runner.kv_caches
        self._allocate(self.num_blocks, num_scratch)
        for (k_new, v_new), (k_old, v_old) in zip(self.runner.kv_caches, old, strict=True):
            k_new[:, : self.num_blocks].copy_(k_old[:, : self.num_blocks])
            v_new[:, : self.num_blocks].copy_(v_old[:, : self.num_blocks])
