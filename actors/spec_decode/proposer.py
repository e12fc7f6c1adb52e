"""The proposer seam: a draft of up to `k` tokens per sequence, asked once per step.

A proposer answers per sequence (`propose`), or for all of a step's speculating sequences at
once (`propose_batch`, which a model proposer needs: one forward per drafted position for the
whole batch, on the engine's ranks)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from actors.request import Sequence
from actors.spec_decode.config import SpeculativeConfig
from actors.spec_decode.draft import DraftRequest

if TYPE_CHECKING:
    from actors.executor.base import Executor


class Proposer(Protocol):
    name: str

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """At most `k` tokens that may follow `seq.token_ids` (none: decode as usual). Called
        on the engine's step thread; state kept per sequence goes on `seq.proposer_state`."""
        ...


class ModelProposer:
    """`draft_model` and `self_draft`: the draft runs where the model does (every rank, see
    actors/spec_decode/draft.py); the engine core asks for the step's drafts in one call."""

    def __init__(self, name: str, executor: Executor):
        self.name = name
        self.executor = executor

    def propose(self, seq: Sequence, k: int) -> list[int]:
        return self.propose_batch([(seq, k)])[0]

    def propose_batch(self, asks: list[tuple[Sequence, int]]) -> list[list[int]]:
        requests = [
            DraftRequest(
                seq.seq_id, list(seq.token_ids), list(seq.block_table), seq.num_preemptions, k
            )
            for seq, k in asks
        ]
        return self.executor.propose(requests)


def make_proposer(config: SpeculativeConfig, executor: Executor) -> Proposer:
    if config.uses_model:
        return ModelProposer(config.method, executor)
    from actors.spec_decode.ngram import NgramProposer

    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
