"""Attention over a paged KV cache, behind a backend seam.

Cache layout per layer: (num_kv_heads, num_blocks, block_size, head_dim) for K and for V, so
one `index_select` along dim 1 gathers whole blocks of every head into a (heads, seq, dim)
view that a batched matmul reads directly.
"""

from __future__ import annotations

import abc
import math

import torch
import torch.nn.functional as F

from actors.forward_context import AttentionMetadata, DecodeBucket, DecodeRows, PrefillSeqMeta

# Head dims the CPU prefill kernel is specialised for; others keep torch's SDPA.
PREFILL_KERNEL_HEAD_DIMS = (64, 128)


class AttentionBackend(abc.ABC):
    """Computes attention for one layer of one step.

    Invariants: new K/V are written into the cache at `slot_mapping` before any read; the
    output rows follow the input rows (prefill tokens first, then decode tokens).
    """

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
        k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
        v: torch.Tensor,
        k_cache: torch.Tensor,  # (num_kv_heads, num_blocks, block_size, head_dim)
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # (num_tokens, num_heads * head_dim)
        ...


class TorchPagedAttention(AttentionBackend):
    """Pure torch: per-sequence SDPA for prefill chunks, bucketed padded matmuls for decode.

    Gather buffers are kept between calls so a step allocates nothing per layer.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        window: int | None = None,
        prefill_kernel: bool = False,
    ):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group = num_heads // num_kv_heads
        self.scale = 1.0 / math.sqrt(head_dim)
        self.window = window or 0
        # fp32 prefill chunks with no window through the engine's CPU kernel
        # (actors/csrc/prefill_attention.cpp), where the platform allows it.
        self.prefill_kernel = prefill_kernel and head_dim in PREFILL_KERNEL_HEAD_DIMS
        self._k_buf: torch.Tensor | None = None
        self._v_buf: torch.Tensor | None = None
        # (layer's cache address, bucket slot) -> that bucket's K and V gather buffers.
        self._kept: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def retain(self, slots: set[int]) -> None:
        """Free the kept gather buffers of bucket slots not in `slots`."""
        for key in [k for k in self._kept if k[1] not in slots]:
            del self._kept[key]

    def forward(self, q, k, v, k_cache, v_cache, meta):  # type: ignore[override]
        h_kv, _, block_size, d = k_cache.shape
        # (num_tokens, kv_heads, d) -> (kv_heads, num_tokens, d) into the flat slot view.
        k_cache.view(h_kv, -1, d).index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
        v_cache.view(h_kv, -1, d).index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
        out = torch.empty(q.shape[0], self.num_heads * d, dtype=q.dtype, device=q.device)
        for p in meta.prefills:
            out[p.q_start : p.q_start + p.q_len] = self._prefill(q, k, v, k_cache, v_cache, p)
        n = meta.num_prefill_tokens
        if meta.decode_rows is not None:
            out[n:] = self._decode_in_place(q[n:], k_cache, v_cache, meta.decode_rows)
        for bucket in meta.decode_buckets:
            rows = bucket.rows + n
            out[rows] = self._decode(q.index_select(0, rows), k_cache, v_cache, bucket)
        return out

    def _decode_in_place(self, q, k_cache, v_cache, rows: DecodeRows) -> torch.Tensor:
        raise NotImplementedError("this backend gathers: the runner gives it decode buckets")

    def _prefill(self, q, k, v, k_cache, v_cache, p: PrefillSeqMeta) -> torch.Tensor:
        h_kv, _, block_size, d = k_cache.shape
        qs = q[p.q_start : p.q_start + p.q_len].transpose(0, 1)  # (heads, q_len, d)
        if p.block_table is None:
            ks = k[p.q_start : p.q_start + p.q_len].transpose(0, 1)
            vs = v[p.q_start : p.q_start + p.q_len].transpose(0, 1)
        else:
            ks = k_cache.index_select(1, p.block_table).view(h_kv, -1, d)[:, : p.ctx_len]
            vs = v_cache.index_select(1, p.block_table).view(h_kv, -1, d)[:, : p.ctx_len]
        plain = p.mask is None or not self.window  # causal over the cached prefix, no window
        if self.prefill_kernel and plain and qs.dtype == torch.float32:
            # The kernel needs no mask for that. Against the SDPA call below, one layer of
            # the trained model, 1 thread: 0.90-1.21 vs 1.36-1.99 ms at 256 tokens, 1.53-2.16
            # vs 1.74-2.39 ms for 100 after 612 cached (benchmarks/prefill_attention.py).
            return torch.ops.serve_app.prefill_attention(qs, ks, vs, self.scale)
        # Batched (4-D) inputs: with 3-D ones torch takes its math path, which builds the
        # whole score matrix; 4-D ones reach the fused kernels (flash on CPU). Measured on
        # 2 cores, 8 heads over 4 KV heads: 2.0 -> 0.76 ms at 213 tokens, 49 -> 10.5 ms at
        # 1,024, 16 -> 9.8 ms for a 512-token chunk after 512 cached (fp32; bf16 alike).
        o = F.scaled_dot_product_attention(
            qs.unsqueeze(0),
            ks.unsqueeze(0),
            vs.unsqueeze(0),
            attn_mask=p.mask,
            is_causal=p.mask is None,
            scale=self.scale,
            enable_gqa=self.group > 1,
        )
        return o[0].transpose(0, 1).reshape(p.q_len, -1)

    def _buffers(self, numel: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._k_buf is None or self._k_buf.numel() < numel or self._k_buf.device != like.device:
            self._k_buf = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._v_buf = torch.empty(numel, dtype=like.dtype, device=like.device)
        assert self._v_buf is not None
        return self._k_buf[:numel], self._v_buf[:numel]

    def _kept_buffers(self, numel: int, k_cache: torch.Tensor, slot: int):
        """This layer's buffers for a bucket slot, and whether they are the ones last used."""
        key = (k_cache.data_ptr(), slot)
        kept = self._kept.get(key)
        if kept is not None and kept[0].numel() == numel:
            return kept, True
        like = dict(dtype=k_cache.dtype, device=k_cache.device)
        kept = (torch.empty(numel, **like), torch.empty(numel, **like))
        self._kept[key] = kept
        return kept, False

    def _decode(self, q, k_cache, v_cache, bucket: DecodeBucket) -> torch.Tensor:
        h_kv, _, block_size, d = k_cache.shape
        b = q.shape[0]
        num_slots = bucket.max_blocks * block_size
        numel = h_kv * b * num_slots * d
        rows = (h_kv * b * bucket.max_blocks, block_size * d)
        by_row = k_cache.view(-1, block_size * d), v_cache.view(-1, block_size * d)
        if bucket.persist:
            (k_flat, v_flat), same = self._kept_buffers(numel, k_cache, bucket.slot)
        else:
            (k_flat, v_flat), same = self._buffers(numel, k_cache), False
        if same and bucket.reuse:
            # Last step's gather of the same blocks: only each sequence's newest block moved.
            for flat, cache in ((k_flat, by_row[0]), (v_flat, by_row[1])):
                fresh = cache.index_select(0, bucket.fresh_rows)
                flat.view(rows).index_copy_(0, bucket.fresh_pos, fresh)
        else:
            torch.index_select(by_row[0], 0, bucket.head_rows, out=k_flat.view(rows))
            torch.index_select(by_row[1], 0, bucket.head_rows, out=v_flat.view(rows))
        ks = k_flat.view(h_kv * b, num_slots, d)
        vs = v_flat.view(h_kv * b, num_slots, d)
        # (b, heads, d) -> (kv_heads * b, group, d): GQA as rows, no K/V expansion.
        qg = q.view(b, h_kv, self.group, d).transpose(0, 1).reshape(h_kv * b, self.group, d)
        if bucket.score_mask is None:  # the same for every layer: built at the first
            mask = bucket.mask.unsqueeze(1).expand(b, self.group, num_slots)
            mask = mask.unsqueeze(0).expand(h_kv, b, self.group, num_slots)
            bucket.score_mask = mask.reshape(h_kv * b, self.group, num_slots)
        scores = torch.baddbmm(bucket.score_mask, qg, ks.transpose(1, 2), alpha=self.scale)
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        o = torch.bmm(probs, vs)  # (kv_heads * b, group, d)
        return o.view(h_kv, b, self.group * d).transpose(0, 1).reshape(b, -1)


class InPlacePagedAttention(TorchPagedAttention):
    """Prefill as `TorchPagedAttention`; decode through the engine's CPU kernel, which reads
    each sequence's blocks where they lie (actors/csrc/paged_attention.cpp): no gather copy,
    no padding, no score mask, and one call per layer for all decode rows.

    Against the gathering path on this repository's 2-core machine (one layer, fp32): 0.20
    vs 0.41 ms at 16 sequences of ~140 tokens (9 heads over 3 KV heads), 0.47 vs 1.30 ms at
    64 with two threads (docs/engine.md has the whole-step figures)."""

    def _decode_in_place(self, q, k_cache, v_cache, rows: DecodeRows) -> torch.Tensor:
        return torch.ops.serve_app.paged_decode_attention(
            q.contiguous(),
            k_cache,
            v_cache,
            rows.block_tables,
            rows.row_seq,
            rows.row_ctx,
            self.window,
            self.scale,
        )
