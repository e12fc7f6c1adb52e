"""End to end over HTTP with the official `openai` client against the real Serve graph."""

from __future__ import annotations

import json

import httpx
import pytest

from actors import LLM, SamplingParams

pytestmark = pytest.mark.serve

CHAT = [{"role": "user", "content": "Say something about JSON."}]


def _sse_events(serve_url: str, path: str, body: dict) -> list[dict | str]:
    events: list[dict | str] = []
    with httpx.stream("POST", f"{serve_url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_models_and_server_info(serve_url, client, model_id):
    info = httpx.get(f"{serve_url}/v1/server_info").json()
    assert info["model"] == model_id
    for key in ("weights_sha256", "tokenizer_sha256", "chat_template_sha256", "fingerprint"):
        assert info["artifact"][key]
    assert info["grammar_backend"]["backend"] == "xgrammar"
    assert info["parameter_policy"]["ignored_fields"] == [
        "user",
        "metadata",
        "store",
        "service_tier",
    ]
    assert info["limits"]["max_model_len"] == 1024
    assert "special tokens are not added" in info["token_id_prompts"]


def test_chat_greedy_usage_and_length(serve_url, client, model_id):
    # A prompt of more than one KV block, so that a repeat has a full block to reuse.
    block_size = httpx.get(f"{serve_url}/v1/server_info").json()["engine"]["block_size"]
    long_chat = [{"role": "user", "content": "Say something about JSON. " * (block_size // 4)}]
    r = client.chat.completions.create(
        model=model_id,
        messages=long_chat,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert r.system_fingerprint.startswith("fp_")
    assert r.usage.prompt_tokens > block_size
    again = client.chat.completions.create(
        model=model_id,
        messages=long_chat,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert again.choices[0].message.content == choice.message.content
    # The second time the prompt's full blocks come from the prefix cache (all but the one
    # holding its last token, which is computed again).
    cached = (r.usage.prompt_tokens - 1) // block_size * block_size
    assert again.usage.prompt_tokens_details.cached_tokens == cached > 0
    assert again.usage.prompt_tokens == r.usage.prompt_tokens


def test_stream_joined_equals_non_stream_and_order(serve_url, client, model_id):
    body = {
        "model": model_id,
        "messages": CHAT,
        "max_tokens": 20,
        "temperature": 0,
        "n": 2,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = _sse_events(serve_url, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 40
    texts = {0: "", 1: ""}
    seen_role, finished = set(), set()
    for e in events[:-2]:
        (c,) = e["choices"]
        i = c["index"]
        assert i not in finished, "nothing after a choice's finish chunk"
        if "role" in c["delta"]:
            seen_role.add(i)
        else:
            assert i in seen_role, "role delta comes first"
        texts[i] += c["delta"].get("content") or ""
        if c["finish_reason"]:
            finished.add(i)
            assert c["finish_reason"] == "length"
    assert finished == {0, 1}
    plain = client.chat.completions.create(
        model=model_id, messages=CHAT, max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
    )
    assert texts[0] == texts[1] == plain.choices[0].message.content


def test_http_greedy_matches_offline_llm(client, model_id, model_dirs):
    prompt = "The quick brown fox jumps over"
    r = client.completions.create(
        model=model_id, prompt=prompt, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    llm = LLM(model=str(model_dirs("llama")))
    offline = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    assert r.choices[0].text == offline[0].text
    ids = offline[0].prompt_token_ids
    by_ids = client.completions.create(
        model=model_id, prompt=ids, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    assert by_ids.choices[0].text == offline[0].text


def test_completions_multiple_prompts_echo_and_logprobs(client, model_id):
    r = client.completions.create(
        model=model_id, prompt=["alpha", "beta gamma"], max_tokens=5, n=2, temperature=0, logprobs=3
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text  # greedy samples of one prompt agree
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 5
    assert all(len(t) == 3 for t in lp.top_logprobs)
    echoed = client.completions.create(model=model_id, prompt="alpha", max_tokens=3, echo=True)
    assert echoed.choices[0].text.startswith("alpha")


def test_sampling_parameters_change_output(client, model_id):
    def run(extra=None, **kw):
        r = client.chat.completions.create(
            model=model_id,
            messages=CHAT,
            max_tokens=24,
            extra_body={"ignore_eos": True, **(extra or {})},
            **kw,
        )
        return r.choices[0].message.content

    greedy = run(temperature=0)
    assert run(temperature=1.0, seed=1) == run(temperature=1.0, seed=1)
    assert run(temperature=1.0, seed=1) != run(temperature=1.0, seed=2)
    assert run({"top_k": 1}, temperature=1.0, seed=5) == greedy
    assert run({"min_p": 1.0}, temperature=1.0, seed=6) == greedy
    assert run(temperature=0, frequency_penalty=2.0) != greedy


def test_stop_strings_and_logprobs(client, model_id):
    base = (
        client.chat.completions.create(
            model=model_id,
            messages=CHAT,
            max_tokens=30,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .message.content
    )
    stop = base[6:9]
    r = client.chat.completions.create(
        model=model_id,
        messages=CHAT,
        max_tokens=30,
        temperature=0,
        stop=[stop],
        logprobs=True,
        top_logprobs=2,
    )
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.message.content == base[: base.find(stop)]
    assert c.model_extra["stop_reason"] == stop
    assert all(len(t.top_logprobs) == 2 for t in c.logprobs.content)


@pytest.mark.parametrize(
    ("body", "status", "code", "param"),
    [
        ({"model": "nope", "messages": CHAT}, 404, "model_not_found", "model"),
        ({"messages": CHAT, "bogus_field": 1}, 400, "unknown_parameter", "bogus_field"),
        (
            {"messages": CHAT, "stream_options": {"include_usage": True}},
            400,
            "invalid_request",
            "stream_options",
        ),
        (
            {"messages": CHAT, "logprobs": True, "top_logprobs": 50},
            400,
            "invalid_request",
            "top_logprobs",
        ),
        ({"messages": CHAT, "max_tokens": 5000}, 400, "max_tokens_exceeded", "max_tokens"),
        (
            {"messages": [{"role": "user", "content": "word " * 1200}]},
            400,
            "context_length_exceeded",
            "messages",
        ),
        ({"messages": CHAT, "temperature": 9}, 400, "invalid_request", "temperature"),
        ({"messages": CHAT, "logit_bias": {"5": 1}}, 400, "unsupported_parameter", "logit_bias"),
    ],
)
def test_errors_have_the_documented_shape(serve_url, model_id, body, status, code, param):
    body = {"model": model_id, **body}
    r = httpx.post(f"{serve_url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == (code, param)
    assert err["message"] and err["type"]
    assert r.headers["x-should-retry"] == "false"


def test_malformed_json_and_ignored_fields(serve_url, model_id):
    r = httpx.post(
        f"{serve_url}/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
    ok = httpx.post(
        f"{serve_url}/v1/chat/completions",
        json={"model": model_id, "messages": CHAT, "max_tokens": 2, "user": "u1", "store": False},
        timeout=30,
    )
    assert ok.status_code == 200


def test_more_parameters_do_what_they_promise(client, model_id, model_dirs):
    def chat(max_tokens=24, **extra):
        r = client.chat.completions.create(
            model=model_id,
            messages=CHAT,
            temperature=extra.pop("temperature", 0),
            max_tokens=max_tokens,
            extra_body={"ignore_eos": True, **extra},
        )
        return r.choices[0].message.content

    base = chat()
    short = client.chat.completions.create(
        model=model_id,
        messages=CHAT,
        temperature=0,
        max_completion_tokens=5,
        extra_body={"ignore_eos": True},
    )
    assert short.usage.completion_tokens == 5 and base.startswith(short.choices[0].message.content)
    # top_p keeping only the most likely token is greedy whatever the temperature.
    assert chat(temperature=1.0, top_p=1e-6, seed=3) == base
    assert chat(presence_penalty=2.0) != base
    assert chat(repetition_penalty=3.0) != base

    # Stop on a token id the greedy run produces (ids from the offline engine, same model).
    llm = LLM(model=str(model_dirs("llama")))
    greedy = llm.generate(["abc"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    ids, text = greedy[0].token_ids, greedy[0].text
    stop_id = ids[4]
    before = llm.tokenizer.decode(ids[:4])

    def complete(**extra):
        return client.completions.create(
            model=model_id, prompt="abc", max_tokens=12, temperature=0, extra_body=extra
        ).choices[0]

    r = complete(stop_token_ids=[stop_id], ignore_eos=True)
    assert (r.finish_reason, r.text) == ("stop", before)
    kept = complete(stop_token_ids=[stop_id], include_stop_str_in_output=True, ignore_eos=True)
    assert kept.text == llm.tokenizer.decode(ids[:5]) and text.startswith(kept.text)
    # min_tokens holds EOS back: the answer has at least that many tokens.
    r = client.chat.completions.create(
        model=model_id,
        messages=CHAT,
        max_tokens=30,
        temperature=1.0,
        seed=9,
        extra_body={"min_tokens": 20},
    )
    assert r.usage.completion_tokens >= 20


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_return_token_ids_gives_the_ids_streamed_or_not(serve_url, model_id, model_dirs, path):
    """The `return_token_ids` extension (as vLLM): each choice's generated ids and the prompt's
    ids; a stream's per-chunk fragments join to the same ids. Without it, neither field."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dirs("llama")))
    chat = path.endswith("chat/completions")
    body = {"model": model_id, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "n": 2}
    body |= {"messages": CHAT} if chat else {"prompt": "The cat sat on"}
    plain = httpx.post(f"{serve_url}{path}", json=body, timeout=60).json()
    assert "prompt_token_ids" not in plain
    assert not {"token_ids", "prompt_token_ids"} & set(plain["choices"][0])
    asked = {**body, "return_token_ids": True}
    whole = httpx.post(f"{serve_url}{path}", json=asked, timeout=60).json()
    events = _sse_events(serve_url, path, {**asked, "stream": True})
    assert events[-1] == "[DONE]"
    chunks = [c for e in events[:-1] for c in e["choices"]]
    num_prompt = whole["usage"]["prompt_tokens"]
    for choice in whole["choices"]:
        ids = choice["token_ids"]
        text = choice["message"]["content"] if chat else choice["text"]
        assert len(ids) == 12 and tokenizer.decode(ids, skip_special_tokens=True) == text
        own = [c for c in chunks if c["index"] == choice["index"]]
        assert [t for c in own for t in c.get("token_ids", [])] == ids
        if not chat:  # each choice names its prompt, on its first chunk when streamed
            assert len(choice["prompt_token_ids"]) == num_prompt
            assert own[0]["prompt_token_ids"] == choice["prompt_token_ids"]
    if chat:  # one prompt for all choices, on the stream's first chunk
        assert len(whole["prompt_token_ids"]) == num_prompt
        assert events[0]["prompt_token_ids"] == whole["prompt_token_ids"]
