"""Reasoning parser: `<think>` spans split off exactly, whatever the chunking, in every mode."""

from __future__ import annotations

import random

import pytest

from serve_app.parsers.reasoning import ReasoningChunk, ThinkReasoningParser, prompt_opens_reasoning
from serve_app.parsers.tools import HermesToolParser, ToolCallArgsDelta, collect

THOUGHT = "Let me see: 1 < 2 </thinking>."
UTF8 = "naïve — 日本"
# (enabled, starts_in_reasoning, text, reasoning, content)
CASES = [
    # enabled: the output opens with a think block
    (True, False, f"<think>\n{THOUGHT}\n</think>\n\nIt is 4.", THOUGHT, "It is 4."),
    (True, False, "\n <think>a</think>b\n", "a", "b\n"),
    (True, False, "<think>\n\n</think>\n\nHi", "", "Hi"),
    (True, False, f"<think>{UTF8}</think>🎉 <think>x</think>", UTF8, "🎉 <think>x</think>"),
    (True, False, "<think>cut off while thinking\n", "cut off while thinking", ""),
    (True, False, "<think>a</thi", "a</thi", ""),
    # enabled, but the output does not open with one: all content, verbatim
    (True, False, "Hello <think>x</think>", "", "Hello <think>x</think>"),
    (True, False, "  <thin", "", "  <thin"),
    (True, False, "\n\n", "", "\n\n"),
    # the prompt ended inside <think>: reasoning from the first character
    (True, True, "I should call.\n</think>\n\nDone.", "I should call.", "Done."),
    (True, True, "no end in sight", "no end in sight", ""),
    # disabled (the template pre-filled an empty block): content, verbatim
    (False, False, "The answer.", "", "The answer."),
    (False, False, "<think>a</think>\n\nb", "", "<think>a</think>\n\nb"),
]


def chunkings(text: str, seed: int) -> list[list[str]]:
    out = [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]
    rng = random.Random(seed)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return out


@pytest.mark.parametrize(("enabled", "starts", "text", "reasoning", "content"), CASES)
def test_split_is_exact_and_chunking_invariant(enabled, starts, text, reasoning, content):
    parser = ThinkReasoningParser(enabled, starts_in_reasoning=starts)
    assert parser.parse(text) == ReasoningChunk(reasoning, content)
    for chunks in chunkings(text, seed=len(text)):
        parser = ThinkReasoningParser(enabled, starts_in_reasoning=starts)
        outs = [parser.feed(chunk) for chunk in chunks] + [parser.finish()]
        assert "".join(o.reasoning for o in outs) == reasoning
        assert "".join(o.content for o in outs) == content
        # One channel after the other: no reasoning once content has started.
        first_content = next((i for i, o in enumerate(outs) if o.content), len(outs))
        assert not any(o.reasoning for o in outs[first_content + 1 :])


def test_tags_are_held_back_until_decided():
    parser = ThinkReasoningParser()
    assert parser.feed("<thi") == ReasoningChunk()
    assert parser.in_reasoning
    assert parser.feed("nk>abc </th") == ReasoningChunk("abc")
    assert parser.feed("ink>\n") == ReasoningChunk()
    assert not parser.in_reasoning
    assert parser.feed("\nanswer") == ReasoningChunk("", "answer")
    assert parser.finish() == ReasoningChunk()


def test_prompt_decides_where_the_output_starts(model_dirs):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dirs("llama"))
    messages = [{"role": "user", "content": "hi"}]
    off = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    on = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert off.endswith("<think>\n\n</think>\n\n") and not prompt_opens_reasoning(off)
    assert not prompt_opens_reasoning(on)
    assert prompt_opens_reasoning(on + "<think>\n")
    parser = ThinkReasoningParser.for_prompt(on + "<think>\n")
    assert parser.parse("why\n</think>\n\nso") == ReasoningChunk("why", "so")
    assert not ThinkReasoningParser.for_prompt(on + "<think>\n", enabled=False).starts_in_reasoning


def test_state_belongs_to_one_stream():
    parser = ThinkReasoningParser()
    parser.feed("<think>a")
    assert parser.parse("plain") == ReasoningChunk("", "plain")
    assert parser.feed("b</think>c") == ReasoningChunk("b", "c")
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")


def test_reasoning_then_tool_calls_chain_per_delta():
    """How a request with both parsers runs: reasoning first, its content into the tool parser."""
    call = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    text = "<think>I will ping.</think>\n\nOK " + call
    for chunks in chunkings(text, seed=1):
        reasoning_parser = ThinkReasoningParser()
        tool_parser = HermesToolParser(["ping"], stream_arguments=True)
        reasoning, events = "", []
        for chunk in [*chunks, None]:
            out = reasoning_parser.feed(chunk) if chunk is not None else reasoning_parser.finish()
            reasoning += out.reasoning
            events += tool_parser.feed(out.content)
        events += tool_parser.finish()
        parsed = collect(events)
        assert reasoning == "I will ping." and parsed.content == "OK"
        assert [(c.name, c.arguments_json) for c in parsed.tool_calls] == [("ping", "{}")]
        assert any(isinstance(e, ToolCallArgsDelta) for e in events)
