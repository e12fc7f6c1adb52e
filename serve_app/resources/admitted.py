"""An admitted generation: everything its admission decided, before it is recorded and run.

Built by a family's admission (`serve_app.generations.admission`), recorded and run by the
runner (`serve_app.resources.runner`), held while it runs (`serve_app.resources.running`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from actors.sampling_params import SamplingParams
from serve_app.grammar.spec import GrammarSpec
from serve_app.store.base import ConversationTurn, GenerationRecord, IdempotencyKey


@dataclass
class AdmittedGeneration:
    """An admitted generation: everything decided before it is recorded."""

    record: GenerationRecord  # status queued
    prompt_ids: list[int]
    params: SamplingParams
    grammar: GrammarSpec | None
    output_format: str
    schema: dict[str, Any] | None  # the named schema (without the refusal branch)
    deadline: float  # time.time() by which the engine must have ended it
    idempotency: IdempotencyKey | None = None
    turn: ConversationTurn | None = None
    turn_messages: list[dict[str, Any]] = field(default_factory=list)
    # Called once when the generation ends (or is never created) with the tokens it used:
    # settles the key's budget reservation.
    on_end: Callable[[int], None] | None = None
    # The engine's prefix-cache namespace, derived from the authenticated tenant.
    cache_namespace: str = ""

    def end(self, num_tokens: int) -> None:
        on_end, self.on_end = self.on_end, None
        if on_end is not None:
            on_end(num_tokens)
