"""SamplingParams: validation at construction, normalisation of convenient spellings."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from actors.sampling_params import MAX_LOGPROBS, SamplingParams

INVALID: list[tuple[str, dict[str, Any]]] = [
    ("n", {"n": 0}),
    ("n", {"n": "2"}),
    ("n", {"n": True}),
    ("max_tokens", {"max_tokens": 0}),
    ("max_tokens", {"max_tokens": None}),
    ("max_tokens", {"max_tokens": 8.0}),
    ("min_tokens", {"min_tokens": -1}),
    ("min_tokens", {"min_tokens": 5, "max_tokens": 4}),
    ("temperature", {"temperature": -0.1}),
    ("temperature", {"temperature": math.inf}),
    ("temperature", {"temperature": math.nan}),
    ("temperature", {"temperature": None}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": 1.01}),
    ("top_p", {"top_p": math.nan}),
    ("top_k", {"top_k": -2}),
    ("top_k", {"top_k": 1.5}),
    ("min_p", {"min_p": -0.1}),
    ("min_p", {"min_p": 1.1}),
    ("repetition_penalty", {"repetition_penalty": 0.0}),
    ("repetition_penalty", {"repetition_penalty": -1.0}),
    ("repetition_penalty", {"repetition_penalty": math.inf}),
    ("presence_penalty", {"presence_penalty": 2.5}),
    ("presence_penalty", {"presence_penalty": -2.1}),
    ("frequency_penalty", {"frequency_penalty": 3}),
    ("frequency_penalty", {"frequency_penalty": math.nan}),
    ("seed", {"seed": -1}),
    ("seed", {"seed": "7"}),
    ("logprobs", {"logprobs": -1}),
    ("logprobs", {"logprobs": MAX_LOGPROBS + 1}),
    ("prompt_logprobs", {"prompt_logprobs": -1}),
    ("prompt_logprobs", {"prompt_logprobs": MAX_LOGPROBS + 1}),
    ("prompt_logprobs", {"prompt_logprobs": True}),
    ("stop", {"stop": [""]}),
    ("stop", {"stop": ""}),
    ("stop", {"stop": ["ok", 3]}),
    ("stop", {"stop": 5}),
    ("stop_token_ids", {"stop_token_ids": [-1]}),
    ("stop_token_ids", {"stop_token_ids": ["a"]}),
    ("stop_token_ids", {"stop_token_ids": 7}),
]


@pytest.mark.parametrize(("field", "kwargs"), INVALID, ids=lambda v: str(v))
def test_invalid_values_raise_naming_the_field(field: str, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**kwargs)


VALID: list[dict[str, Any]] = [
    {},
    {"n": 4, "seed": 0},
    {"max_tokens": 1, "min_tokens": 1},
    {"temperature": 0.0},
    {"temperature": 0},  # an int where a float is expected
    {"top_p": 1.0, "top_k": 0, "min_p": 0.0},
    {"top_p": 1e-6, "min_p": 1.0, "top_k": 1},
    {"presence_penalty": -2.0, "frequency_penalty": 2.0},
    {"repetition_penalty": 1e-3},
    {"logprobs": 0},
    {"logprobs": MAX_LOGPROBS},
    {"prompt_logprobs": 0},
    {"prompt_logprobs": MAX_LOGPROBS},
    {"stop": None, "stop_token_ids": None},
]


@pytest.mark.parametrize("kwargs", VALID, ids=lambda v: str(v))
def test_boundary_values_are_accepted(kwargs: dict[str, Any]) -> None:
    params = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        if value is not None:
            assert getattr(params, name) == value


def test_unknown_keywords_are_named() -> None:
    with pytest.raises(ValueError, match="best_of, max_token"):
        SamplingParams(max_token=5, best_of=2)


@pytest.mark.parametrize(
    ("stop", "expected"),
    [("###", ("###",)), (["a", "bc"], ("a", "bc")), (("x",), ("x",)), (None, ()), ([], ())],
)
def test_stop_becomes_a_tuple(stop: Any, expected: tuple[str, ...]) -> None:
    assert SamplingParams(stop=stop).stop == expected


def test_stop_token_ids_become_a_tuple_of_ints() -> None:
    assert SamplingParams(stop_token_ids=[3, 7]).stop_token_ids == (3, 7)
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()


@pytest.mark.parametrize("top_k", [0, -1])
def test_top_k_zero_or_minus_one_disables_it(top_k: int) -> None:
    params = SamplingParams(top_k=top_k)
    assert params.top_k == 0
    assert not params.needs_top_filter
    assert params == SamplingParams()


def test_derived_flags() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=0.5).is_greedy
    assert SamplingParams(presence_penalty=0.1).needs_penalties
    assert not SamplingParams().needs_penalties
    assert SamplingParams(min_p=0.1).needs_top_filter


def test_frozen_and_hashable() -> None:
    params = SamplingParams(stop=["a"], max_tokens=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.max_tokens = 5  # type: ignore[misc]
    assert {params: 1}[SamplingParams(stop="a", max_tokens=3)] == 1


def test_replace_revalidates() -> None:
    params = SamplingParams(temperature=0.5, stop="x")
    shorter = dataclasses.replace(params, max_tokens=3)
    assert (shorter.max_tokens, shorter.temperature, shorter.stop) == (3, 0.5, ("x",))
    with pytest.raises(ValueError, match="^temperature"):
        dataclasses.replace(params, temperature=-1.0)
