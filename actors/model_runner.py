"""One rank's model, KV cache and step execution: StepInput -> tensors -> forward -> sample."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from actors.config import CacheConfig, ModelConfig
from actors.forward_context import (
    AttentionMetadata,
    DecodeBucket,
    DecodeRows,
    PrefillSeqMeta,
    set_forward_context,
)
from actors.layers.attention import InPlacePagedAttention, TorchPagedAttention
from actors.mask_buffer import VocabMaskBuffer
from actors.messages import (
    GrammarMasks,
    PromptLogprobsChunk,
    ScheduledItem,
    StepInput,
    StepOutput,
)
from actors.models.loader import build_model
from actors.parallel_state import get_tp_group
from actors.platform import (
    cpu_prefill_attention,
    cpu_sampler_kernels,
    inplace_decode_attention,
    kv_cache_budget_bytes,
    persistent_decode_gather,
)
from actors.prompt_logprobs import compute_prompt_logprobs
from actors.sampler import Sampler, SeqSamplingState
from actors.spec_decode.config import SpeculativeConfig
from actors.spec_decode.draft import DraftRequest, DraftRunner
from actors.spec_decode.verify import Verifier

# A decode bucket closes when the next (shorter) context would pad it by more than this.
_BUCKET_MIN_FILL = 0.75
_BUCKET_MIN_SIZE = 4
# Kept decode gathers (all layers) may take at most this share of the KV cache's bytes. On
# 128 rows of 16-256-token prompts and 16-256 new tokens (batch 64), 1.0 made LLM.generate
# 699-742 tok/s against 628-671 at 0.25.
_KEPT_GATHER_SHARE = 1.0


@dataclass
class _Pending:
    """A step between `forward` and `sample`."""

    step: StepInput
    logits: torch.Tensor | None = None
    prompt_logprobs: list[PromptLogprobsChunk] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        device: torch.device,
        seed=0,
        speculative_config: SpeculativeConfig | None = None,
        build: Callable[[TorchPagedAttention], nn.Module] | None = None,
    ):
        self.config = model_config
        # The engine core settles the block size first; a runner built alone settles it here.
        self.cache_config = cache_config.settled(device.type == "cuda")
        self.device = device
        tp = get_tp_group()
        self.is_driver = tp.rank == 0
        heads = model_config.num_heads // tp.world_size
        kv_heads = max(1, model_config.num_kv_heads // tp.world_size)
        # Decode reads the paged cache in place where the engine's CPU kernel runs; else
        # (CUDA, or no compiler) it gathers each bucket's blocks for torch's matmuls.
        self.in_place_decode = inplace_decode_attention(device)
        backend = InPlacePagedAttention if self.in_place_decode else TorchPagedAttention
        self.backend: TorchPagedAttention = backend(
            heads,
            kv_heads,
            model_config.head_dim,
            model_config.sliding_window,
            prefill_kernel=cpu_prefill_attention(device),
        )
        if build is None:
            self.model = build_model(model_config, self.backend, device)
        else:  # a model made of another's parts (the self-draft's)
            self.model = build(self.backend)
        self.num_local_kv_heads = self.backend.num_kv_heads
        self.block_size: int = self.cache_config.block_size  # type: ignore[assignment]
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.head_offsets = torch.zeros(0, dtype=torch.long)
        self.sampler = Sampler(
            model_config.vocab_size, model_config.eos_token_ids, seed, cpu_sampler_kernels()
        )
        self.states: dict[str, SeqSamplingState] = {}
        self._pending: _Pending | None = None
        self.keep_gathers = persistent_decode_gather(device) and not self.in_place_decode
        self.kept_gather_budget = 0
        # Per bucket slot of the last step that completed: the key of its kept gather, or None.
        self._gathered: list[tuple | None] = []
        # Decode buckets built, and those served from the last step's gather.
        self.gather_counts = {"buckets": 0, "kept": 0}
        # The grammar masks every sample reads (`register_vocab_mask_buffer`).
        self.mask_buffer = VocabMaskBuffer(model_config.vocab_size, device)
        # Samples steps that verify drafts, and keeps a model's drafts (rank 0) until then.
        self.verifier = Verifier(self.sampler)
        # A model proposer's draft runner.
        self.draft: DraftRunner | None = None
        if speculative_config is not None and speculative_config.uses_model:
            self.draft = DraftRunner(
                speculative_config,
                model_config,
                self.cache_config,
                device,
                self.model,
                ModelRunner,
                seed,
            )

    def register_vocab_mask_buffer(self, num_rows: int) -> tuple[int, ...]:
        """Allocate the step's grammar-mask buffer once (rows: every sampled position a step
        can have); registering again must name the same shape, else it raises. Returns the
        shape, which every TP rank must agree on."""
        return self.mask_buffer.register(num_rows)

    # ------------------------------------------------------------------ KV cache
    @property
    def bytes_per_block(self) -> int:
        c = self.config
        elem = torch.empty((), dtype=c.dtype).element_size()
        return 2 * c.num_layers * self.num_local_kv_heads * self.block_size * c.head_dim * elem

    def determine_num_blocks(self) -> int:
        if self.cache_config.num_blocks is not None:
            return self.cache_config.num_blocks
        budget = kv_cache_budget_bytes(self.cache_config.memory_budget_bytes, self.device)
        # A draft model keeps KV in the same block ids: a block costs both.
        per_block = self.bytes_per_block + (self.draft.bytes_per_block if self.draft else 0)
        return max(1, budget // per_block)

    def init_kv_cache(self, num_blocks: int) -> None:
        c = self.config
        shape = (self.num_local_kv_heads, num_blocks, self.block_size, c.head_dim)
        # Zeros, not empty: padded decode reads masked slots, and 0 * NaN would poison them.
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=c.dtype, device=self.device),
                torch.zeros(shape, dtype=c.dtype, device=self.device),
            )
            for _ in range(c.num_layers)
        ]
        # Where each KV head's rows start in a layer's cache seen as (heads * blocks, ...).
        self.head_offsets = torch.arange(self.num_local_kv_heads, device=self.device) * num_blocks
        self.kept_gather_budget = int(_KEPT_GATHER_SHARE * num_blocks * self.bytes_per_block)
        self._gathered = []
        self.backend.retain(set())
        if self.draft is not None:
            self.draft.init_kv_cache(num_blocks, self.kv_caches)

    # ---------------------------------------------------------------- speculation
    def propose(self, requests: list[DraftRequest]) -> list[list[int]] | None:
        """The model proposer's drafts (every rank drafts alike; rank 0 returns them and
        hands them to the verifier, which keeps a sampled request's q)."""
        if self.draft is None:
            raise RuntimeError("propose() on an engine without a model proposer")
        drafts = self.draft.propose(requests, self.states)
        if not self.is_driver:
            return None
        self.verifier.keep([r.seq_id for r in requests], drafts)
        return [d.token_ids for d in drafts]

    @torch.inference_mode()
    def last_logits(self, items: list[ScheduledItem]) -> torch.Tensor:
        """The logits after each item's last token (a forward with no sampling)."""
        input_ids, positions, meta, rows, _ = self._prepare(items)
        with set_forward_context(meta):
            hidden = self.model(input_ids, positions, self.kv_caches)
        return self.model.compute_logits(hidden.index_select(0, rows))

    # ---------------------------------------------------------------------- step
    def execute(self, step: StepInput, masks: GrammarMasks | None = None) -> StepOutput | None:
        self.forward(step)
        return self.sample(masks)

    @torch.inference_mode()
    def forward(self, step: StepInput) -> None:
        """Run the step's forward; `sample` then draws its tokens (the grammar masks may
        arrive in between: they fill while this runs)."""
        for seq_id in step.finished_seq_ids:
            self.states.pop(seq_id, None)
            self.verifier.forget(seq_id)
            if self.draft is not None:
                self.draft.forget(seq_id)
        for new in step.new_seqs:
            self.states[new.seq_id] = SeqSamplingState(
                new.params, new.prompt_token_ids, [], new.seed
            )
        # Kept gathers are valid only after a step that completed.
        previous, self._gathered = self._gathered, []
        self._pending = _Pending(step)
        if not step.items:
            return
        input_ids, positions, meta, logits_rows, row_starts = self._prepare(step.items, previous)
        with set_forward_context(meta):
            hidden = self.model(input_ids, positions, self.kv_caches)
        self._gathered = [bucket.key for bucket in meta.decode_buckets]
        self._pending.logits = self.model.compute_logits(hidden.index_select(0, logits_rows))
        if any(item.prompt_logprobs is not None for item in step.items):
            prompts = {i.seq_id: self.states[i.seq_id].prompt_token_ids for i in step.items}
            self._pending.prompt_logprobs = compute_prompt_logprobs(
                self.model.compute_logits, hidden, step.items, row_starts, prompts, self.is_driver
            )

    @torch.inference_mode()
    def sample(self, masks: GrammarMasks | None = None) -> StepOutput | None:
        """Draw the tokens of the step `forward` ran (rank 0 only; other ranks return None).
        A step with drafts to verify goes to the verifier."""
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("sample() without a forward() before it")
        if not self.is_driver:
            return None
        if pending.logits is None:
            return StepOutput(sampled_token_ids=[])
        sampled = [item for item in pending.step.items if item.sample]
        bitmask, rows = None, None
        if masks is not None:
            bitmask, rows = self.mask_buffer.load(masks.bitmask), masks.rows
        # The logits are this step's own: the sampler may write into them.
        if any(item.num_draft for item in sampled):
            out = self.verifier.sample(sampled, self.states, pending.logits, bitmask, rows)
        else:
            states = [self.states[item.seq_id] for item in sampled]
            tokens, logprobs = self.sampler(pending.logits, states, bitmask, rows, writable=True)
            out = StepOutput(tokens, logprobs)
        out.prompt_logprobs = pending.prompt_logprobs
        return out

    def _prepare(self, items: list[ScheduledItem], previous: list[tuple | None] | None = None):
        """Flatten the step: prefill chunks first, then decode rows (single tokens, and where
        decode reads the cache in place, drafts under verification: one row per position,
        sharing the sequence's block table). Also returns the row of each item's first token,
        in item order."""
        bs = self.block_size
        in_place = self.in_place_decode

        def is_decode(item: ScheduledItem) -> bool:
            return len(item.token_ids) == 1 or (in_place and item.num_draft > 0)

        order = sorted(range(len(items)), key=lambda i: is_decode(items[i]))
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        rows_of_item: dict[int, range] = {}
        row_starts = [0] * len(items)
        meta = AttentionMetadata(slot_mapping=torch.empty(0))
        decode_ctx: list[int] = []
        decode_tables: list[list[int]] = []
        decode_row_seq: list[int] = []
        decode_ids: list[str] = []
        for i in order:
            item = items[i]
            q_start, q_len = len(input_ids), len(item.token_ids)
            row_starts[i] = q_start
            ctx_len = item.start_pos + q_len
            input_ids.extend(item.token_ids)
            for pos in range(item.start_pos, ctx_len):
                positions.append(pos)
                slots.append(item.block_table[pos // bs] * bs + pos % bs)
            if item.sample:
                # The last own token's logits, then one row after each proposed token.
                rows_of_item[i] = range(len(input_ids) - 1 - item.num_draft, len(input_ids))
            if is_decode(item):
                for pos in range(item.start_pos, ctx_len):
                    decode_ctx.append(pos + 1)
                    decode_row_seq.append(len(decode_tables))
                decode_tables.append(item.block_table)
                decode_ids.append(item.seq_id)
            else:
                meta.prefills.append(self._prefill_meta(item, q_start, q_len, ctx_len))
                meta.num_prefill_tokens = len(input_ids)
        meta.slot_mapping = torch.tensor(slots, dtype=torch.long, device=self.device)
        if in_place:
            meta.decode_rows = self._decode_rows(decode_ctx, decode_row_seq, decode_tables)
        else:
            meta.decode_buckets = self._decode_buckets(
                decode_ctx, decode_tables, decode_ids, previous or []
            )
        # Logit rows in item order, which is the order the caller expects samples in.
        logits_rows = [r for i in range(len(items)) if i in rows_of_item for r in rows_of_item[i]]
        to_dev = dict(dtype=torch.long, device=self.device)
        return (
            torch.tensor(input_ids, **to_dev),
            torch.tensor(positions, **to_dev),
            meta,
            torch.tensor(logits_rows, **to_dev),
            row_starts,
        )

    def _prefill_meta(self, item: ScheduledItem, q_start: int, q_len: int, ctx_len: int):
        window = self.config.sliding_window
        plain_causal = item.start_pos == 0 and (window is None or ctx_len <= window)
        table = None
        mask = None
        if item.start_pos > 0:
            n_blocks = -(-ctx_len // self.block_size)
            table = torch.tensor(item.block_table[:n_blocks], dtype=torch.long, device=self.device)
        if not plain_causal:
            q_pos = torch.arange(item.start_pos, ctx_len, device=self.device).unsqueeze(1)
            k_pos = torch.arange(ctx_len, device=self.device).unsqueeze(0)
            allowed = k_pos <= q_pos
            if window is not None:
                allowed &= (q_pos - k_pos) < window
            mask = self._additive(allowed)
        return PrefillSeqMeta(q_start, q_len, ctx_len, table, mask)

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        zero = torch.zeros((), dtype=self.config.dtype, device=self.device)
        return torch.where(allowed, zero, torch.finfo(self.config.dtype).min)

    def _decode_rows(
        self, ctx: list[int], row_seq: list[int], tables: list[list[int]]
    ) -> DecodeRows | None:
        if not ctx:
            return None
        width = -(-max(ctx) // self.block_size)
        padded = [table[:width] + [0] * (width - len(table[:width])) for table in tables]
        as_int = dict(dtype=torch.int32, device=self.device)
        return DecodeRows(
            block_tables=torch.tensor(padded, **as_int),
            row_seq=torch.tensor(row_seq, **as_int),
            row_ctx=torch.tensor(ctx, **as_int),
        )

    def _decode_buckets(
        self, ctx: list[int], tables: list[list[int]], ids: list[str], previous: list
    ) -> list[DecodeBucket]:
        if not ctx:
            self.backend.retain(set())
            return []
        bs = self.block_size
        by_len = sorted(range(len(ctx)), key=lambda i: -ctx[i])
        groups: list[list[int]] = [[]]
        for i in by_len:
            group = groups[-1]
            if len(group) >= _BUCKET_MIN_SIZE and ctx[i] < _BUCKET_MIN_FILL * ctx[group[0]]:
                groups.append([i])
            else:
                group.append(i)
        window = self.config.sliding_window
        buckets = []
        kept_bytes = 0
        for slot, group in enumerate(groups):
            max_blocks = -(-ctx[group[0]] // bs)
            flat: list[int] = []
            for i in group:
                table = tables[i][:max_blocks]
                flat.extend(table + [0] * (max_blocks - len(table)))
            lens = torch.tensor([ctx[i] for i in group], device=self.device).unsqueeze(1)
            k_pos = torch.arange(max_blocks * bs, device=self.device).unsqueeze(0)
            allowed = k_pos < lens
            if window is not None:
                allowed &= k_pos >= lens - window
            flat_ids = torch.tensor(flat, dtype=torch.long, device=self.device)
            bucket = DecodeBucket(
                rows=torch.tensor(group, dtype=torch.long, device=self.device),
                head_rows=(self.head_offsets.unsqueeze(1) + flat_ids).reshape(-1),
                max_blocks=max_blocks,
                mask=self._additive(allowed),
                slot=slot,
            )
            kept_bytes += len(flat) * self.bytes_per_block
            bucket.persist = self.keep_gathers and kept_bytes <= self.kept_gather_budget
            if bucket.persist:
                # Each sequence's block that takes this step's token (its newest).
                fresh = [j * max_blocks + (ctx[i] - 1) // bs for j, i in enumerate(group)]
                bucket.key = (tuple(ids[i] for i in group), max_blocks, flat)
                before = previous[slot] if slot < len(previous) else None
                if before is not None and _only_fresh_changed(before, bucket.key, fresh):
                    heads = torch.arange(self.num_local_kv_heads, device=self.device)
                    pos = (
                        heads.unsqueeze(1) * len(flat) + torch.tensor(fresh, device=self.device)
                    ).reshape(-1)
                    bucket.reuse = True
                    bucket.fresh_pos = pos
                    bucket.fresh_rows = bucket.head_rows.index_select(0, pos)
            buckets.append(bucket)
        self.backend.retain({b.slot for b in buckets if b.persist})
        self.gather_counts["buckets"] += len(buckets)
        self.gather_counts["kept"] += sum(b.reuse for b in buckets)
        return buckets


def _only_fresh_changed(before: tuple, now: tuple, fresh: list[int]) -> bool:
    """Whether a bucket's gather from the last step still holds every block of this one but
    the `fresh` positions: the same sequences in the same order and padding, and no block
    id changed elsewhere (a block table only grows while its sequence keeps decoding)."""
    if before[0] != now[0] or before[1] != now[1]:
        return False
    old, new, width = before[2], now[2], now[1]
    for j, p in enumerate(fresh):
        start, end = j * width, (j + 1) * width
        if old[start:p] != new[start:p] or old[p + 1 : end] != new[p + 1 : end]:
            return False
    return True
