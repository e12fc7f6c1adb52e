"""Paged KV block bookkeeping: ref counts, an LRU free queue and a hash-chained prefix cache.

Plain CPU Python: the tensors live in the workers; this only hands out block ids.
Invariants: a block is either referenced (ref_count > 0) or in the free queue, never both;
`cached` maps a chain hash to the one block holding that content. Every chain starts from its
sequence's cache namespace, so sequences of different namespaces never share a block.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from functools import lru_cache

from actors.request import Sequence


def chain_hash(parent: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    """sha256 over the parent's digest and this block's tokens. A collision would serve
    another prompt's KV silently, so no 64-bit hash: crafted prompts must not alias."""
    h = hashlib.sha256(parent or b"")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@lru_cache(maxsize=4096)
def namespace_root(namespace: str) -> bytes:
    """The parent digest of a sequence's first block. The caller picks the namespace (the
    service: one per tenant); the same tokens under two namespaces hash apart all the way down
    the chain, so one namespace can neither hit nor time another's cached prefix."""
    return hashlib.sha256(
        b"prefix-cache-namespace\0" + namespace.encode("utf-8", "surrogatepass")
    ).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        # Free blocks, least recently used first; cached content is evicted from the front.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _full_block_hashes(self, seq: Sequence, num_tokens: int) -> list[bytes]:
        hashes: list[bytes] = []
        parent = namespace_root(seq.cache_namespace)
        token_ids = seq.token_ids
        for start in range(0, num_tokens - self.block_size + 1, self.block_size):
            parent = chain_hash(parent, tuple(token_ids[start : start + self.block_size]))
            hashes.append(parent)
        return hashes

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of `seq`; at least one token is left to compute."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for h in self._full_block_hashes(seq, seq.num_tokens - 1):
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate(self, seq: Sequence, num_new_tokens: int, hits: list[int] | None = None) -> bool:
        """Grow `seq.block_table` to cover its computed tokens plus `num_new_tokens`.

        `hits` (fresh sequences only) are prefix-cache blocks taken first. Returns False and
        changes nothing when there are not enough free blocks.
        """
        hits = hits or []
        num_tokens = seq.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        num_new_blocks = self.blocks_needed(num_tokens) - len(seq.block_table) - len(hits)
        # Hit blocks sitting in the free queue stop being free once taken.
        num_hits_free = sum(1 for b in hits if self.ref_counts[b] == 0)
        if num_new_blocks > self.num_free_blocks - num_hits_free:
            return False
        for block in hits:
            if self.ref_counts[block] == 0:
                del self.free_queue[block]
            self.ref_counts[block] += 1
        seq.block_table.extend(hits)
        seq.block_hashes.extend(self.block_hash[b] for b in hits)  # type: ignore[misc]
        for _ in range(max(num_new_blocks, 0)):
            seq.block_table.append(self._pop_free())
        return True

    def _pop_free(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        h = self.block_hash[block]
        if h is not None and self.cached.get(h) == block:
            del self.cached[h]
        self.block_hash[block] = None
        self.ref_counts[block] = 1
        return block

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks of `seq` whose tokens are all computed (prompt or output)."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else namespace_root(seq.cache_namespace)
        for i in range(len(seq.block_hashes), num_full):
            start = i * self.block_size
            parent = chain_hash(parent, tuple(seq.token_ids[start : start + self.block_size]))
            seq.block_hashes.append(parent)
            block = seq.block_table[i]
            if parent not in self.cached:
                self.cached[parent] = block
                self.block_hash[block] = parent

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the tail blocks of `seq` beyond those `num_tokens` tokens need (taken
        for positions that turned out not to be kept). They hold no full committed block, so
        nothing cached goes with them."""
        keep = self.blocks_needed(num_tokens)
        while len(seq.block_table) > keep:
            block = seq.block_table.pop()
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None
                self.free_queue.move_to_end(block, last=False)
        del seq.block_hashes[keep:]

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references; tail blocks first so shared prefixes stay cached longest."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None
                if self.block_hash[block] is None:
                    # Nothing reusable inside: hand it out before cached blocks.
                    self.free_queue.move_to_end(block, last=False)
        seq.block_table.clear()
        seq.block_hashes.clear()

    def reset_prefix_cache(self) -> None:
        for h, block in list(self.cached.items()):
            if self.ref_counts[block] == 0:
                del self.cached[h]
                self.block_hash[block] = None
