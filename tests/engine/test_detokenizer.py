"""Incremental detokenization and stop checks, fed one token at a time as the engine does."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer

from actors.config import ModelConfig
from actors.detokenizer import IncrementalDetokenizer
from actors.request import FinishReason, Sequence
from actors.sampling_params import SamplingParams
from actors.stop_checker import check_stop

EOS, IM_END, IM_START = 1, 4, 3  # ids fixed by the model factory
TEXT = "Hello world. STOP here and more"
MULTIBYTE = "héllo wörld — 日本語 🚀 ✓"


@pytest.fixture(scope="module")
def model_path(model_dirs: Callable[..., Path]) -> Path:
    return model_dirs("llama")


@pytest.fixture(scope="module")
def tokenizer(model_path: Path) -> Tokenizer:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path).backend_tokenizer


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


@dataclass
class Streamed:
    deltas: list[str]
    stop: str | None
    # Steps where the output so far ended inside a character (its bytes split over tokens).
    num_partial_steps: int

    @property
    def text(self) -> str:
        return "".join(self.deltas)

    @property
    def emitted(self) -> list[str]:
        """The text a client had seen after each step."""
        return ["".join(self.deltas[: i + 1]) for i in range(len(self.deltas))]


def stream(
    tokenizer: Tokenizer, output_ids: list[int], prompt_ids: list[int] | None = None, **params: Any
) -> Streamed:
    prompt_ids = prompt_ids or []
    detok = IncrementalDetokenizer(tokenizer, len(prompt_ids), SamplingParams(**params))
    token_ids = list(prompt_ids)
    deltas: list[str] = []
    num_partial = 0
    stop = None
    for i, token in enumerate(output_ids):
        token_ids.append(token)
        stop = detok.update(token_ids)
        final = stop is not None or i == len(output_ids) - 1
        deltas.append(detok.take_delta(final=final))
        if tokenizer.decode(token_ids[len(prompt_ids) :]).endswith("\ufffd"):
            num_partial += 1
            assert deltas[-1] == "" or final  # nothing shown while a character is incomplete
        if stop is not None:
            break
    return Streamed(deltas, stop, num_partial)


# ---------------------------------------------------------------- UTF-8 safe streaming


@pytest.mark.parametrize(
    ("text", "prompt"),
    [
        ("Hello world. This is a test of streaming.", ""),
        (MULTIBYTE, ""),
        (MULTIBYTE, "Translate: "),
        ("🚀🚀🧪👩‍🔬 ok", "emoji: "),
        ("def f(x):\n    return x ** 2  # ✓\n", "```python\n"),
    ],
)
def test_streamed_deltas_join_to_decode(tokenizer: Tokenizer, text: str, prompt: str) -> None:
    output_ids = encode(tokenizer, text)
    streamed = stream(tokenizer, output_ids, encode(tokenizer, prompt))
    assert streamed.text == tokenizer.decode(output_ids) == text
    assert not any("\ufffd" in d for d in streamed.deltas)
    if not text.isascii():
        # Byte-level BPE split some character over tokens, and the stream waited for it.
        assert streamed.num_partial_steps > 0


def test_partial_characters_are_held_until_complete(tokenizer: Tokenizer) -> None:
    output_ids = encode(tokenizer, "日本語")
    assert len(output_ids) > 3  # each character spans several byte tokens
    streamed = stream(tokenizer, output_ids)
    assert [d for d in streamed.deltas if d] == ["日", "本", "語"]
    assert streamed.num_partial_steps == len(output_ids) - 3


def test_context_window_starting_inside_a_prompt_character(tokenizer: Tokenizer) -> None:
    # The detokenizer re-decodes the last few prompt tokens; here they begin mid-character.
    prompt_ids = encode(tokenizer, "日本語 ok")
    assert tokenizer.decode(prompt_ids[-6:]).startswith("\ufffd")
    output_ids = encode(tokenizer, " 日本 ok")
    streamed = stream(tokenizer, output_ids, prompt_ids)
    assert streamed.text == " 日本 ok"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens_follow_skip_special_tokens(
    tokenizer: Tokenizer, skip_special_tokens: bool
) -> None:
    output_ids = encode(tokenizer, "Hi") + [IM_START] + encode(tokenizer, " there") + [EOS]
    streamed = stream(tokenizer, output_ids, skip_special_tokens=skip_special_tokens)
    expected = "Hi there" if skip_special_tokens else "Hi<|im_start|> there</s>"
    assert streamed.text == expected
    assert expected == tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)


# ---------------------------------------------------------------- stop strings


def _tokens_spanned(tokenizer: Tokenizer, text: str, stop: str) -> int:
    start = text.index(stop)
    offsets = tokenizer.encode(text, add_special_tokens=False).offsets
    return sum(1 for a, b in offsets if a < start + len(stop) and b > start)


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stop", ["d. ST", "STOP", "world. STOP h"])
def test_stop_string_across_tokens_truncates_and_never_leaks(
    tokenizer: Tokenizer, stop: str, include: bool
) -> None:
    assert _tokens_spanned(tokenizer, TEXT, stop) >= 2
    output_ids = encode(tokenizer, TEXT)
    streamed = stream(tokenizer, output_ids, stop=stop, include_stop_str_in_output=include)
    cut = TEXT.index(stop) + (len(stop) if include else 0)
    assert streamed.stop == stop
    assert streamed.text == TEXT[:cut]
    # Held back: at no step had the client seen text beyond the final answer.
    assert all(streamed.text.startswith(seen) for seen in streamed.emitted)
    # It stopped on the token that completed the stop string, not later.
    end = TEXT.index(stop) + len(stop)
    offsets = tokenizer.encode(TEXT, add_special_tokens=False).offsets
    assert len(streamed.deltas) == 1 + next(i for i, (_, b) in enumerate(offsets) if b >= end)


def test_text_that_only_looked_like_a_stop_is_released(tokenizer: Tokenizer) -> None:
    output_ids = encode(tokenizer, TEXT)
    streamed = stream(tokenizer, output_ids, stop="world!")
    assert streamed.stop is None
    assert streamed.text == TEXT
    # 'wor' and 'ld' were held while they could begin "world!", then released with '.'.
    assert streamed.emitted[3:6] == ["Hello ", "Hello ", "Hello world."]


def test_held_prefix_is_released_at_the_end(tokenizer: Tokenizer) -> None:
    streamed = stream(tokenizer, encode(tokenizer, "Hello wor"), stop="world")
    assert streamed.stop is None
    assert streamed.deltas[-1] == " wor"
    assert streamed.text == "Hello wor"


@pytest.mark.parametrize(
    ("text", "stops", "expected_stop", "expected_text"),
    [
        (TEXT, ["STOP", "world"], "world", "Hello "),
        (TEXT, ["world", "STOP"], "world", "Hello "),
        # Both complete on the token 're'; "ere" starts first.
        (TEXT, ["re", "ere"], "ere", "Hello world. STOP h"),
        (TEXT, ["ere", "re"], "ere", "Hello world. STOP h"),
        (TEXT, ["and more", "nothing"], "and more", "Hello world. STOP here "),
        ("ok 日本語 done", ["本語", "done"], "本語", "ok 日"),
    ],
)
def test_several_stop_strings_earliest_wins(
    tokenizer: Tokenizer, text: str, stops: list[str], expected_stop: str, expected_text: str
) -> None:
    streamed = stream(tokenizer, encode(tokenizer, text), stop=stops)
    assert (streamed.stop, streamed.text) == (expected_stop, expected_text)
    assert all(expected_text.startswith(seen) for seen in streamed.emitted)


def test_include_stop_cuts_text_after_the_stop_in_the_same_token(tokenizer: Tokenizer) -> None:
    # "Hel" ends inside the token 'lo'.
    output_ids = encode(tokenizer, TEXT)
    assert stream(tokenizer, output_ids, stop="Hel", include_stop_str_in_output=True).text == "Hel"
    assert stream(tokenizer, output_ids, stop="Hel").text == ""


def test_stop_string_in_the_prompt_is_ignored(tokenizer: Tokenizer) -> None:
    prompt_ids = encode(tokenizer, "Say STOP")
    streamed = stream(tokenizer, encode(tokenizer, " and more"), prompt_ids, stop="STOP")
    assert (streamed.stop, streamed.text) == (None, " and more")


# ---------------------------------------------------------------- check_stop (engine order)


@dataclass
class TokensOf:
    """max_tokens equal to the number of tokens in the first `num_pieces` pieces."""

    num_pieces: int


class FakeConstraint:
    def __init__(self, num_tokens: int) -> None:
        self.num_left = num_tokens

    def accept(self, token: int) -> None:
        self.num_left -= 1

    def is_terminated(self) -> bool:
        return self.num_left <= 0


@dataclass
class StopCase:
    name: str
    # Output pieces: text (encoded on its own) or a raw token id.
    pieces: list[str | int]
    params: dict[str, Any]
    reason: FinishReason | None
    stop_reason: str | int | None
    # How many pieces were consumed when it finished (all of them when reason is None).
    num_pieces_used: int
    text: str
    max_model_len: int | None = None
    constraint_tokens: int | None = None


DOT = "."  # its token id is looked up at run time
STOP_CASES = [
    StopCase("eos", ["Hello", EOS, " world"], {}, FinishReason.STOP, None, 2, "Hello"),
    StopCase("second eos id", ["Hello", IM_END, " x"], {}, FinishReason.STOP, None, 2, "Hello"),
    StopCase(
        "ignore_eos",
        ["Hello", EOS, " world"],
        {"ignore_eos": True, "max_tokens": TokensOf(3)},
        FinishReason.LENGTH,
        None,
        3,
        "Hello world",
    ),
    StopCase(
        "eos before min_tokens",
        ["H", EOS, " there", EOS, "!"],
        {"min_tokens": 3},
        FinishReason.STOP,
        None,
        4,
        "H there",
    ),
    StopCase(
        "stop token id",
        ["Hello world", DOT, " STOP"],
        {"stop_token_ids": [DOT]},
        FinishReason.STOP,
        DOT,
        2,
        "Hello world",
    ),
    StopCase(
        "stop token id, included",
        ["Hello world", DOT, " STOP"],
        {"stop_token_ids": [DOT], "include_stop_str_in_output": True},
        FinishReason.STOP,
        DOT,
        2,
        "Hello world.",
    ),
    StopCase(
        "stop string",
        ["Hello world. ", "STOP", " here"],
        {"stop": "STOP"},
        FinishReason.STOP,
        "STOP",
        2,
        "Hello world. ",
    ),
    StopCase(
        "stop string inside min_tokens",
        ["STOP", " and some more words ", "STOP", " again"],
        {"stop": ["STOP"], "min_tokens": 4},
        FinishReason.STOP,
        "STOP",
        3,
        "STOP and some more words ",
    ),
    StopCase(
        "max_tokens",
        ["H", "e", "y", " there"],
        {"max_tokens": 3},
        FinishReason.LENGTH,
        None,
        3,
        "Hey",
    ),
    StopCase(
        "max_model_len",
        ["a", "b", "c"],
        {},
        FinishReason.LENGTH,
        None,
        2,
        "ab",
        max_model_len=2,
    ),
    StopCase(
        "eos beats max_tokens",
        ["H", EOS, "x"],
        {"max_tokens": 2},
        FinishReason.STOP,
        None,
        2,
        "H",
    ),
    StopCase(
        "stop string beats max_tokens",
        ["Hello world. ", "STOP", " here"],
        {"stop": "STOP", "max_tokens": TokensOf(2)},
        FinishReason.STOP,
        "STOP",
        2,
        "Hello world. ",
    ),
    StopCase(
        "grammar terminated",
        ["a", "b", "c"],
        {},
        FinishReason.STOP,
        "grammar_end",
        2,
        "ab",
        constraint_tokens=2,
    ),
    StopCase("runs on", ["Hello", " world"], {"max_tokens": 50}, None, None, 2, "Hello world"),
]


@pytest.mark.parametrize("case", STOP_CASES, ids=lambda c: c.name)
def test_check_stop(case: StopCase, tokenizer: Tokenizer, model_path: Path) -> None:
    dot = tokenizer.token_to_id(DOT)

    def ids_of(pieces: list[str | int]) -> list[int]:
        ids: list[int] = []
        for piece in pieces:
            if piece == DOT:
                ids.append(dot)
            else:
                ids += [piece] if isinstance(piece, int) else encode(tokenizer, piece)
        return ids

    params = dict(case.params)
    if isinstance(params.get("max_tokens"), TokensOf):
        params["max_tokens"] = len(ids_of(case.pieces[: params["max_tokens"].num_pieces]))
    params["stop_token_ids"] = [dot if t == DOT else t for t in params.get("stop_token_ids", [])]
    sampling = SamplingParams(**params)
    prompt_ids = encode(tokenizer, "Prompt:")
    max_model_len = None if case.max_model_len is None else len(prompt_ids) + case.max_model_len
    model = ModelConfig.from_pretrained(
        model_path, dtype=torch.float32, max_model_len=max_model_len
    )
    assert set(model.eos_token_ids) == {EOS, IM_END}
    seq = Sequence("r#0", "r", 0, list(prompt_ids), len(prompt_ids), sampling)
    if case.constraint_tokens is not None:
        seq.constraint = FakeConstraint(case.constraint_tokens)
    detok = IncrementalDetokenizer(tokenizer, len(prompt_ids), sampling)

    text, reason, stop_reason = "", None, None
    for token in ids_of(case.pieces):
        seq.token_ids.append(token)
        if seq.constraint is not None:
            seq.constraint.accept(token)
        reason, stop_reason = check_stop(seq, token, model, detok)
        text += detok.take_delta(final=reason is not None)
        if reason is not None:
            break

    expected_stop = dot if case.stop_reason == DOT else case.stop_reason
    assert (reason, stop_reason, text) == (case.reason, expected_stop, case.text)
    assert seq.output_token_ids == ids_of(case.pieces[: case.num_pieces_used])
