"""Per-sequence grammar constraint over xgrammar: fill the next-token mask, accept tokens.

The engine core asks `fill_bitmask` for every constrained row before a step and `accept`s
the sampled token after it; sequences without a constraint share the same step untouched.
"""

from __future__ import annotations

import torch
import xgrammar as xgr


class GrammarConstraint:
    def __init__(self, compiled: xgr.CompiledGrammar, max_rollback_tokens: int = 0):
        self.matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=max_rollback_tokens)
        self.num_rejected = 0

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        ok = self.matcher.accept_token(token_id)
        if not ok:
            # Only reachable if the mask was not applied; counted so tests can prove it is not.
            self.num_rejected += 1
        return ok

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    return xgr.allocate_token_bitmask(num_rows, vocab_size)
