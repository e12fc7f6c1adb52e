"""Prompt logprobs over HTTP: `echo` with `logprobs` on completions (whole and streamed) and
the `prompt_logprobs` extension on both endpoints, against the offline engine's values."""

from __future__ import annotations

import json

import httpx
import pytest

from actors import LLM, SamplingParams

pytestmark = pytest.mark.serve

# 40 ids: two full KV blocks and a tail, so a repeat would find a cached prefix.
PROMPT_IDS = [(37 * i) % 1500 + 20 for i in range(40)]
CHAT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def engine_logprobs(model_dirs):
    """The offline engine's prompt logprobs (top 3) of a prompt, as the reference."""
    llm = LLM(model=str(model_dirs("llama")))
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=3)
    cache: dict[tuple[int, ...], list] = {}

    def get(prompt_ids: list[int]) -> list:
        key = tuple(prompt_ids)
        if key not in cache:
            cache[key] = llm.generate([list(prompt_ids)], params)[0].prompt_logprobs
        return cache[key]

    yield get
    llm.shutdown()


def _post(serve_url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{serve_url}{path}", json=body, timeout=60)


def _check_field(field: list, prompt_ids: list[int], reference: list, k: int) -> None:
    """vLLM's `prompt_logprobs`: aligned with the prompt, first null, then per position the
    prompt's own token (its rank) and up to k alternatives ranked 1..k."""
    assert len(field) == len(prompt_ids) and field[0] is None
    for token_id, entry, ref in zip(prompt_ids[1:], field[1:], reference[1:], strict=True):
        own = entry[str(token_id)]
        assert own["logprob"] == pytest.approx(ref.logprob, abs=1e-4)
        assert own["rank"] == ref.rank and isinstance(own["decoded_token"], str)
        alternatives = {str(t): v for t, v in ref.top[:k]}
        assert set(entry) == alternatives.keys() | {str(token_id)}
        for t, v in alternatives.items():
            assert entry[t]["logprob"] == pytest.approx(v, abs=1e-4)
        assert sorted(e["rank"] for t, e in entry.items() if t in alternatives) == list(
            range(1, len(alternatives) + 1)
        )


def test_echo_with_logprobs_scores_the_prompt_even_behind_a_cached_prefix(
    serve_url, client, model_id, engine_logprobs
):
    # Cache the prompt's blocks first: the echo must still score every prompt token.
    client.completions.create(model=model_id, prompt=PROMPT_IDS, max_tokens=1)
    greedy = {"model": model_id, "prompt": PROMPT_IDS, "max_tokens": 4, "temperature": 0}
    r = client.completions.create(**greedy, logprobs=2, echo=True, extra_body={"ignore_eos": True})
    choice, n = r.choices[0], len(PROMPT_IDS)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    reference = engine_logprobs(PROMPT_IDS)
    for got, ref in zip(lp.token_logprobs[1:n], reference[1:], strict=True):
        assert got == pytest.approx(ref.logprob, abs=1e-4)
    assert all(len(top) <= 2 for top in lp.top_logprobs[1:])
    assert all(v is not None for v in lp.token_logprobs[n:])
    # The text starts with the echoed prompt; generated offsets continue after it.
    plain = client.completions.create(**greedy, extra_body={"ignore_eos": True})
    echoed = choice.text[: len(choice.text) - len(plain.choices[0].text)]
    assert choice.text == echoed + plain.choices[0].text and echoed
    assert lp.text_offset[0] == 0 and lp.text_offset[n] == len(echoed)
    assert lp.text_offset == sorted(lp.text_offset)
    # The prompt was recomputed for its logprobs, not served from the cache.
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert r.usage.prompt_tokens == n


def test_streamed_echo_brings_the_prompt_and_its_logprobs_first(serve_url, client, model_id):
    body = {
        "model": model_id, "prompt": "The colour of the sky is", "max_tokens": 5,
        "temperature": 0, "logprobs": 1, "echo": True, "ignore_eos": True,
    }  # fmt: skip
    whole = _post(serve_url, "/v1/completions", body).json()["choices"][0]
    chunks = []
    with httpx.stream(
        "POST", f"{serve_url}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: ") :])["choices"][0])
    first = chunks[0]
    assert first["text"] == "The colour of the sky is"
    assert first["logprobs"]["token_logprobs"][0] is None
    num_prompt = len(first["logprobs"]["tokens"])
    assert num_prompt == len(whole["logprobs"]["tokens"]) - 5
    # Each prompt token sits at its offset in the text; the generated ones start after it.
    lp = whole["logprobs"]
    for token, offset in zip(lp["tokens"][:num_prompt], lp["text_offset"], strict=False):
        assert whole["text"][offset : offset + len(token)] == token
    assert lp["text_offset"][num_prompt] == len(first["text"])
    joined = {"text": "", "tokens": [], "token_logprobs": [], "text_offset": []}
    for c in chunks:
        joined["text"] += c["text"]
        for key in ("tokens", "token_logprobs", "text_offset"):
            joined[key] += (c["logprobs"] or {}).get(key, [])
    assert joined["text"] == whole["text"]
    for key in ("tokens", "token_logprobs", "text_offset"):
        assert joined[key] == pytest.approx(whole["logprobs"][key], abs=1e-5), key


def test_prompt_logprobs_on_completions_per_prompt(serve_url, model_id, engine_logprobs):
    other = PROMPT_IDS[:9]
    body = {
        "model": model_id, "prompt": [PROMPT_IDS, other], "n": 2, "max_tokens": 2,
        "prompt_logprobs": 2,
    }  # fmt: skip
    r = _post(serve_url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    for choice in choices:
        prompt = PROMPT_IDS if choice["index"] < 2 else other
        _check_field(choice["prompt_logprobs"], prompt, engine_logprobs(prompt), 2)
        # Without `echo` the completion's own logprobs and text are unchanged.
        assert choice["logprobs"] is None
    # Without the parameter the field is not there at all.
    plain = _post(serve_url, "/v1/completions", {**body, "prompt_logprobs": None}).json()
    assert all("prompt_logprobs" not in c for c in plain["choices"])


def test_prompt_logprobs_on_chat_follow_the_templated_prompt(serve_url, model_id, engine_logprobs):
    body = {
        "model": model_id, "messages": CHAT, "max_tokens": 2, "prompt_logprobs": 0,
        "return_token_ids": True,
    }  # fmt: skip
    r = _post(serve_url, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    data = r.json()
    prompt_ids = data["prompt_token_ids"]
    _check_field(data["prompt_logprobs"], prompt_ids, engine_logprobs(prompt_ids), 0)
    assert all(len(e) == 1 for e in data["prompt_logprobs"][1:])  # k = 0: the token only


@pytest.mark.parametrize(
    ("path", "changes"),
    [("/v1/completions", {"prompt_logprobs": -1}),
     ("/v1/completions", {"prompt_logprobs": 21}),
     ("/v1/chat/completions", {"prompt_logprobs": 99}),
     ("/v1/chat/completions", {"prompt_logprobs": 1, "stream": True})],
)  # fmt: skip
def test_bad_prompt_logprobs_are_400_naming_the_field(serve_url, model_id, path, changes):
    prompt = {"messages": CHAT} if "chat" in path else {"prompt": "hi"}
    r = _post(serve_url, path, {"model": model_id, "max_tokens": 1, **prompt, **changes})
    assert r.status_code == 400
    assert r.headers["x-should-retry"] == "false"
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_request", "prompt_logprobs")
