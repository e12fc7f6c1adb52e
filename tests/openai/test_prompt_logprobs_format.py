"""The wire shapes of prompt logprobs: vLLM's `prompt_logprobs` list and the echoed part of a
completions `logprobs` object (no server: the formatter alone)."""

from __future__ import annotations

from actors.messages import TokenLogprobs
from serve_app.openai.format import echoed_logprobs, prompt_logprobs_field

PIECES = {1: "<s>", 10: "The", 11: " sky", 12: " is", 13: " sea"}


class FakeTexts:
    def get(self, token_id: int) -> tuple[str, bytes]:
        text = PIECES[token_id]
        return text, text.encode()


PROMPT = [1, 10, 11, 12]
LOGPROBS = [
    None,
    TokenLogprobs(-7.0, 40, [(13, -1.0), (11, -2.0)]),
    TokenLogprobs(-2.0, 2, [(13, -1.5), (11, -2.0)]),
    TokenLogprobs(-1e6, 900, [(10, -0.5), (13, -3.0)]),
]


def test_prompt_logprobs_field_holds_the_token_and_the_top_k() -> None:
    field = _wire(prompt_logprobs_field(FakeTexts(), PROMPT, LOGPROBS, k=2))
    assert field[0] is None
    assert field[1] == {
        "10": _candidate(-7.0, 40, "The"),
        "13": _candidate(-1.0, 1, " sea"),
        "11": _candidate(-2.0, 2, " sky"),
    }
    # The prompt's own token is among the top-k: it appears once, with its own rank.
    assert field[2] == {"11": _candidate(-2.0, 2, " sky"), "13": _candidate(-1.5, 1, " sea")}
    # JSON has no -Infinity: OpenAI's floor.
    assert field[3]["12"]["logprob"] == -9999.0
    assert list(prompt_logprobs_field(FakeTexts(), PROMPT, LOGPROBS, k=0)[1]) == ["10"]


def test_echoed_offsets_index_the_echoed_text() -> None:
    # A string prompt's echo lacks the BOS the tokenizer added: it sits at 0, the rest align.
    lp = echoed_logprobs(FakeTexts(), PROMPT, LOGPROBS, k=1, echo_len=len("The sky is"))
    assert lp.tokens == ["<s>", "The", " sky", " is"]
    assert lp.text_offset == [0, 0, 3, 7]
    assert lp.token_logprobs == [None, -7.0, -2.0, -9999.0]
    assert lp.top_logprobs == [None, {" sea": -1.0}, {" sea": -1.5}, {"The": -0.5}]
    # A token-id prompt's echo is its decoded ids, BOS text included.
    assert echoed_logprobs(FakeTexts(), PROMPT, LOGPROBS, 1, len("<s>The sky is")).text_offset == [
        0,
        3,
        6,
        10,
    ]


def _wire(field: list) -> list:
    return [None if e is None else {t: c.to_dict() for t, c in e.items()} for e in field]


def _candidate(logprob: float, rank: int, text: str) -> dict:
    return {"logprob": logprob, "rank": rank, "decoded_token": text}
