"""The proposer seam: a draft of up to `k` tokens per sequence, asked once per step."""

from __future__ import annotations

from typing import Protocol

from actors.request import Sequence
from actors.spec_decode.config import SpeculativeConfig


class Proposer(Protocol):
    name: str

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """At most `k` tokens that may follow `seq.token_ids` (none: decode as usual). Called
        on the engine's step thread; state kept per sequence goes on `seq.proposer_state`."""
        ...


def make_proposer(config: SpeculativeConfig) -> Proposer:
    from actors.spec_decode.ngram import NgramProposer

    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
