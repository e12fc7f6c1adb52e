"""What the engine reports: per-step deltas, and the accumulated results of the offline API."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from operator import attrgetter

from actors.messages import TokenLogprobs
from actors.request import FinishReason


@dataclass
class CompletionDelta:
    """New output of one sample since the previous step."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One step's news for one request (only samples that changed)."""

    request_id: str
    prompt_token_ids: list[int]
    deltas: list[CompletionDelta]
    num_cached_tokens: int
    finished: bool
    # Set when the request ended in an error (engine lost, grammar failed to compile, ...).
    error: str | None = None
    error_code: str | None = None
    # On the last output: when sample 0 was scheduled, got its grammar and its first token
    # (seconds from arrival), so grammar/prefill overlap can be read per request.
    timeline: dict[str, float | None] | None = None
    # The attempt this output belongs to (the fence: a closed attempt's outputs are dropped).
    attempt: int = 0
    # When the params ask: the prompt's logprobs, aligned with `prompt_token_ids` (index 0 is
    # None), on the request's first output only (the prompt is computed before any sample).
    prompt_logprobs: list[TokenLogprobs | None] | None = None


def _pickle_positionally(cls: type) -> None:
    """Pickle `cls` as its constructor and its fields in order, not as a class reference
    plus an attribute dict: a smaller payload, and unpickled by one call instead of an
    object made empty and then filled. These cross a Serve hop once per step per request
    (`serve_app.ray_env.data_plane_options`): with `pickle`, a channel batch of 64 encodes
    in 1.8 µs an output against 2.2 and decodes in 1.1 against 2.4, and takes 116 bytes an
    output against 157 (`benchmarks/channel_wire.py`). Every field is an `__init__`
    argument."""
    get = attrgetter(*(f.name for f in fields(cls)))

    def __reduce__(self):
        return cls, get(self)

    cls.__reduce__ = __reduce__


_pickle_positionally(CompletionDelta)
_pickle_positionally(RequestOutput)


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None

    def add(self, delta: CompletionDelta) -> None:
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason.value
            self.stop_reason = delta.stop_reason


@dataclass
class GenerationResult:
    """A finished request: `outputs` has one entry per sample; the properties read sample 0."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    # Aligned with `prompt_token_ids` (index 0 is None) when the params asked.
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        return self.outputs[0].stop_reason

    @property
    def logprobs(self) -> list[TokenLogprobs] | None:
        return self.outputs[0].logprobs
