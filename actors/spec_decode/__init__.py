"""Speculative decoding: proposers behind one seam, verification of `1 + k` positions in one
forward, and acceptance that commits only what the target model itself would have produced.

`SpeculativeConfig` names the method (vLLM's spelling); `make_proposer` builds it. The engine
core asks the proposer for each eligible decode sequence's draft before scheduling, the
scheduler gives the sequence `1 + len(draft)` positions of the step, and the runner's `Verifier`
returns the tokens the verification commits (`accept_draft`, `accept_sampled`).
"""

from actors.spec_decode.backoff import Backoff
from actors.spec_decode.config import SpeculativeConfig
from actors.spec_decode.ngram import NgramProposer
from actors.spec_decode.proposer import Proposer, make_proposer
from actors.spec_decode.verify import accept_draft

__all__ = [
    "Backoff",
    "NgramProposer",
    "Proposer",
    "SpeculativeConfig",
    "accept_draft",
    "make_proposer",
]
