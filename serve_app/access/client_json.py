"""Client JSON: every JSON text a client sends (a body, a schema given as a string) is parsed
here, bounded before it is decoded.

- Nesting: at most `MAX_JSON_DEPTH` levels of arrays and objects. Python's decoder (and every
  recursive walk after it: pydantic, schema canonicalisation, hashing) would otherwise meet
  `"[" * 10000` as a RecursionError, a 500. The depth is measured on the raw text, at C speed,
  before anything recursive runs.
- Text: a lone UTF-16 surrogate escape (`"\\ud800"`) is valid JSON syntax but not Unicode;
  the tokenizer and UTF-8 stores cannot encode it. It is refused here, naming where it is.
- NaN and Infinity are not JSON (Python's decoder accepts them).

Each refusal is a 400 `invalid_request`.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable
from typing import Any

from serve_app import errors

MAX_JSON_DEPTH = 128

# A `\uD800`-`\uDFFF` escape somewhere (a valid pair matches too: then the decoded value is
# walked to find a lone one). Raw surrogate bytes are not UTF-8 and fail decoding anyway.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_BRACKETS = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}
# Every byte but quotes and brackets (bytes.translate deletes these).
_NOT_SKELETON = bytes(range(256)).translate(None, b'"[]{}')


def loads(
    text: str | bytes | bytearray,
    param: str | None = None,
    *,
    syntax_error: Callable[[str, str | None], errors.APIError] = errors.invalid_request,
) -> Any:
    """The value of a client's JSON text, or a 400 naming `param` (None: the body).
    `syntax_error` builds the error for text that is not JSON (a schema string that does not
    parse is an `invalid_grammar`); depth and surrogates are always `invalid_request`."""
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
    what = "The request body" if param is None else f"'{param}'"
    depth = nesting_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise errors.invalid_request(
            f"{what} nests JSON {depth} levels deep; the limit max_json_depth allows at most "
            f"{MAX_JSON_DEPTH}.",
            param,
        )
    try:
        value = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        # JSONDecodeError is a ValueError; so is the NaN/Infinity refusal.
        raise syntax_error(f"{what} is not valid JSON: {exc}", param) from None
    if _SURROGATE_ESCAPE.search(raw):
        check_text(value, param)
    return value


def nesting_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in JSON text, brackets inside strings
    excluded. For text that is not JSON the number is meaningless but finite. The work in
    Python is one step per bracket outside strings; the rest runs in C."""
    # Escapes first: a backslash pair is one literal backslash, then `\"` is a quote in a
    # string; what is left of the text is quotes and brackets.
    bare = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    skeleton = bare.translate(None, _NOT_SKELETON)
    # Between quotes is string text: every other piece of the split is outside strings.
    outside = b"".join(skeleton.split(b'"')[::2])
    return max(itertools.accumulate(_BRACKETS[c] for c in outside), default=0)


def check_text(value: Any, param: str | None = None) -> None:
    """Refuse a lone surrogate in any string (or key) of a decoded JSON value, naming the
    dotted path to it (under `param`, when the value is itself a parameter)."""
    stack: list[tuple[Any, tuple[str, ...]]] = [(value, ())]
    while stack:
        node, path = stack.pop()
        if isinstance(node, str):
            if not node.isascii() and _has_surrogate(node):
                raise _lone_surrogate(param, path)
            continue
        if isinstance(node, dict):
            for key, child in node.items():
                if not key.isascii() and _has_surrogate(key):
                    raise _lone_surrogate(param, path)
                stack.append((child, (*path, key)))
        elif isinstance(node, list):
            stack.extend((child, (*path, str(i))) for i, child in enumerate(node))


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _lone_surrogate(param: str | None, path: tuple[str, ...]) -> errors.APIError:
    where = ".".join(p for p in (param, *path) if p) or None
    shown = f"'{where}'" if where else "the request body"
    return errors.invalid_request(
        f"Invalid value for {shown}: it holds a lone UTF-16 surrogate (such as \\ud800), "
        "which is not Unicode text; send valid UTF-8.",
        where,
    )


def _reject_constant(name: str) -> Any:
    # Python's json accepts NaN/Infinity; JSON does not, and a NaN temperature is poison.
    raise ValueError(f"{name} is not a JSON value")
