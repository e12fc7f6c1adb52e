"""Client JSON parsing: nesting bounded before decoding, lone surrogates refused by path."""

from __future__ import annotations

import json

import pytest

from serve_app import errors
from serve_app.access import client_json
from serve_app.access.client_json import MAX_JSON_DEPTH, loads, nesting_depth


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        (b"{}", 1),
        (b"1", 0),
        (b'{"a": [1, [2, {"b": 3}]]}', 4),
        # Brackets inside strings do not count, escaped quotes do not end the string.
        (b'{"a": "[[[[{{{", "b": "\\"[[[", "c": "\\\\"}', 1),
        (b'["\\\\\\"[[[", [1]]', 2),
        (b"[" * 10_000 + b"]" * 10_000, 10_000),
    ],
)
def test_nesting_depth_counts_structure_only(text: bytes, depth: int) -> None:
    assert nesting_depth(text) == depth
    if depth <= 500:  # Python's decoder agrees where it can decode at all
        value = json.loads(text)
        assert _depth(value) == depth


def _depth(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


@pytest.mark.parametrize(
    "text",
    [
        "[" * 10_000 + "]" * 10_000,
        '{"messages": ' + "[" * 5_000 + "]" * 5_000 + "}",
        '{"a": ' * (MAX_JSON_DEPTH + 1) + "1" + "}" * (MAX_JSON_DEPTH + 1),
    ],
)
def test_too_deep_is_a_400_naming_the_limit(text: str) -> None:
    with pytest.raises(errors.APIError) as info:
        loads(text.encode())
    assert (info.value.status, info.value.code) == (400, "invalid_request")
    assert "max_json_depth" in info.value.message and str(MAX_JSON_DEPTH) in info.value.message


def test_the_limit_itself_is_accepted() -> None:
    text = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert _depth(loads(text)) == MAX_JSON_DEPTH


@pytest.mark.parametrize(
    ("text", "param"),
    [
        (r'{"prompt": "a\ud800b"}', "prompt"),
        (r'{"messages": [{"role": "user", "content": "\udfff"}]}', "messages.0.content"),
        (r'{"metadata": {"\ud800": "x"}}', "metadata"),
        (r'"\ud800"', None),
    ],
)
def test_a_lone_surrogate_is_refused_where_it_is(text: str, param: str | None) -> None:
    with pytest.raises(errors.APIError) as info:
        loads(text.encode())
    assert (info.value.status, info.value.code, info.value.param) == (400, "invalid_request", param)
    assert "surrogate" in info.value.message


def test_a_surrogate_pair_and_an_escaped_backslash_are_text() -> None:
    assert loads(rb'{"a": "\ud83d\ude00", "b": "\\ud800"}') == {"a": "\U0001f600", "b": "\\ud800"}


def test_a_string_parameter_names_itself() -> None:
    with pytest.raises(errors.APIError) as info:
        loads(r'{"type": "string", "description": "\ud800"}', "structured_outputs.json")
    assert info.value.param == "structured_outputs.json.description"
    with pytest.raises(errors.APIError) as info:
        loads("{not json", "structured_outputs.json", syntax_error=errors.invalid_grammar)
    assert (info.value.code, info.value.param) == ("invalid_grammar", "structured_outputs.json")


@pytest.mark.parametrize("text", [b'{"t": NaN}', b'{"t": -Infinity}', b"{", b"\xff\xfe{"])
def test_what_is_not_json_is_a_400(text: bytes) -> None:
    with pytest.raises(errors.APIError) as info:
        loads(text)
    assert (info.value.status, info.value.code) == (400, "invalid_request")


def test_check_text_walks_decoded_values() -> None:
    client_json.check_text({"a": ["fine", {"b": "ok"}]})
    with pytest.raises(errors.APIError):
        client_json.check_text({"a": ["fine", {"b": "\ud800"}]})
