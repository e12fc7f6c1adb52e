"""Prompt lookup: propose what followed the latest earlier occurrence of the sequence's suffix.

No extra model: the request's own prompt and output are the draft source, which pays on copy-
heavy work (rewriting a given object, quoting spans, editing code). Per sequence an index maps
each n-gram (`min_n..max_n` tokens) to where its latest occurrence ended; it grows with the
tokens, so a step costs O(new tokens), not O(length).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.request import Sequence


@dataclass
class _Index:
    # n-gram -> index just after its latest occurrence, over n-grams ending before the last token.
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    # Tokens whose n-grams ending there are indexed: positions [0, upto) are covered.
    upto: int = 0


class NgramProposer:
    name = "ngram"

    def __init__(self, min_n: int, max_n: int):
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, seq: Sequence, k: int) -> list[int]:
        tokens = seq.token_ids
        index: _Index | None = seq.proposer_state
        if index is None:
            index = seq.proposer_state = _Index()
        length = len(tokens)
        # Index the n-grams ending at e (exclusive) for e < length: the suffix ending at
        # `length` is the query and must match an earlier occurrence, not itself.
        ends = index.ends
        for end in range(max(index.upto, 1), length):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                ends[tuple(tokens[end - n : end])] = end
        index.upto = max(index.upto, length)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = ends.get(tuple(tokens[length - n :]))
            if end is not None:
                return tokens[end : end + k]
        return []
