"""Body bytes -> a validated request, or an APIError that names the parameter to fix."""

from __future__ import annotations

from typing import Any, Literal, overload

from pydantic import ValidationError

from serve_app import errors
from serve_app.access import client_json
from serve_app.protocol.requests import ChatCompletionRequest, CompletionRequest

_MODELS: dict[str, type[ChatCompletionRequest] | type[CompletionRequest]] = {
    "chat": ChatCompletionRequest,
    "completion": CompletionRequest,
}


@overload
def parse_request(kind: Literal["chat"], body: bytes | dict[str, Any]) -> ChatCompletionRequest: ...
@overload
def parse_request(
    kind: Literal["completion"], body: bytes | dict[str, Any]
) -> CompletionRequest: ...
def parse_request(
    kind: Literal["chat", "completion"], body: bytes | dict[str, Any]
) -> ChatCompletionRequest | CompletionRequest:
    """Validate a request body; every failure is a 400 APIError whose `param` names the field."""
    data = load_json_object(body) if isinstance(body, bytes | bytearray) else body
    if not isinstance(data, dict):
        raise errors.invalid_request("The request body must be a JSON object.")
    try:
        return _MODELS[kind].model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc, data) from None


def load_json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object: depth-bounded, Unicode-checked (`access.client_json`)."""
    data = client_json.loads(body)
    if not isinstance(data, dict):
        raise errors.invalid_request("The request body must be a JSON object.")
    return data


def from_validation_error(exc: ValidationError, data: Any) -> errors.APIError:
    """The one error to report: an unknown field if any, else the most specific failure."""
    details = exc.errors(include_url=False, include_context=False, include_input=False)
    for err in details:
        if err["type"] == "extra_forbidden":
            return errors.unknown_parameter(data_path(err["loc"], data))
    # Unions report one failure per member; the deepest path is the member the input meant.
    paths = [data_path(err["loc"], data) for err in details]
    deepest = max(paths, key=_depth)
    chosen = [e for p, e in zip(paths, details, strict=True) if p == deepest]
    param = deepest or None
    reasons = list(dict.fromkeys(_reason(e) for e in chosen))
    if chosen[0]["type"] == "missing":
        return errors.invalid_request(f"Missing required parameter: '{param}'.", param)
    where = f"'{param}'" if param else "the request"
    return errors.invalid_request(f"Invalid value for {where}: {' or '.join(reasons)}.", param)


def _depth(path: str) -> int:
    return path.count(".") + 1 if path else 0


def _reason(err: Any) -> str:
    message = str(err["msg"])
    # Validators raise ValueError; pydantic prefixes its class name.
    return message.removeprefix("Value error, ").rstrip(".")


def data_path(loc: tuple[int | str, ...], data: Any) -> str:
    """`loc` as a dotted path into the body, without pydantic's union-member tags.

    A loc item is kept when it indexes the data at that point; a final string that is
    not there is the missing (or unknown) field itself; anything else is a union tag.
    """
    parts: list[str] = []
    current = data
    for i, item in enumerate(loc):
        in_dict = isinstance(current, dict) and isinstance(item, str) and item in current
        in_list = isinstance(current, list) and isinstance(item, int) and 0 <= item < len(current)
        if in_dict or in_list:
            current = current[item]
        elif i == len(loc) - 1 and isinstance(item, str) and isinstance(current, dict):
            current = None
        else:
            continue
        parts.append(str(item))
    return ".".join(parts)


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    """Client-supplied prompt ids: each inside the vocabulary (special tokens are taken as
    given, never added). Checked in the ingress: a range check is no tokenizer round trip."""
    for t in token_ids:
        if not 0 <= t < vocab_size:
            raise errors.invalid_request(
                f"token id {t} is outside the vocabulary [0, {vocab_size})", param
            )
