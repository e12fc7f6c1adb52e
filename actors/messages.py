"""Typed messages between the engine core and its workers (they may cross processes).

A step input is sent once per step to every rank; per-sequence constants (sampling params,
prompt) travel once, in `new_seqs`, and workers keep them until `finished_seq_ids` says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from actors.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


@dataclass
class NewSeqData:
    seq_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    # Seed of this sample's private generator (None: the shared one).
    seed: int | None


@dataclass
class ScheduledItem:
    seq_id: str
    # Tokens to compute this step (prompt chunk, recomputation, or the last sampled token).
    token_ids: list[int]
    # Position of token_ids[0] (tokens already in the cache before it).
    start_pos: int
    block_table: list[int]
    # Whether this step ends at the sequence's last token, so its logits are sampled.
    sample: bool
    # Set (to the top-k count) when this chunk's prompt positions must report the logprobs
    # of the prompt tokens that follow them (see actors/prompt_logprobs.py).
    prompt_logprobs: int | None = None
    # Speculation: the last `num_draft` of `token_ids` are proposed, not committed; the step
    # samples after each of the `1 + num_draft` positions and returns what verification keeps.
    num_draft: int = 0


@dataclass
class StepInput:
    items: list[ScheduledItem]
    new_seqs: list[NewSeqData] = field(default_factory=list)
    finished_seq_ids: list[str] = field(default_factory=list)


@dataclass
class GrammarMasks:
    """One step's grammar masks, sent after its StepInput (they fill while the forward runs):
    (num_rows, ceil(vocab / 32)) int32 xgrammar bitmask rows, of which only `rows` apply.
    A row is one sampled position: one per sampled item, `1 + num_draft` for an item that
    verifies a draft (row j: the legal tokens after its first j proposed tokens)."""

    bitmask: torch.Tensor
    rows: list[int]


@dataclass
class TokenLogprobs:
    # The chosen token's logprob and rank (1 = most likely), then the top-k alternatives.
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class PromptLogprobsChunk:
    """One scheduled chunk's prompt logprobs: entries[j] is for the prompt token at index
    `first_index + j` (index 0 has none), scored by the logits of the position before it."""

    seq_id: str
    first_index: int
    entries: list[TokenLogprobs]


@dataclass
class StepOutput:
    # One sampled token per item with `sample=True`, in item order: for an item that verified
    # a draft, the first token it commits.
    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None = None
    # Verifying items only (keyed by the index into `sampled_token_ids`): the tokens committed
    # after the first, in order, and their logprobs when the request asks.
    more_token_ids: dict[int, list[int]] = field(default_factory=dict)
    more_logprobs: dict[int, list[TokenLogprobs | None]] = field(default_factory=dict)
    # Only for items that asked (`ScheduledItem.prompt_logprobs`).
    prompt_logprobs: list[PromptLogprobsChunk] = field(default_factory=list)
    error: str | None = None


@dataclass
class EngineRequest:
    """What the service sends an engine replica for one request (crosses Ray)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # A one-element list holding the compiled grammar's ObjectRef (or None). Boxed so Serve
    # does not resolve it before the call: prefill overlaps compilation.
    grammar: list[object] | None = None
    priority: int = 0
    # The client's deadline, relative to when the engine receives the request.
    timeout_s: float | None = None
    # The attempt number under this request id: outputs of other attempts are fenced off.
    attempt: int = 0
    # The streamed response this request feeds, when its proxy reports a stalled client
    # (serve_app.backpressure.proxy_hold): the engine holds it while that key is paused.
    flow_key: str | None = None
    # Prefix-cache namespace, chosen by the service (never by the client): cached blocks are
    # shared only between requests of the same namespace.
    cache_namespace: str = ""
    # The ingress replica's output channel (serve_app/workers/output_channel.py): when the
    # engine replica has it open, this request's outputs after the first travel in it.
    channel: str | None = None
