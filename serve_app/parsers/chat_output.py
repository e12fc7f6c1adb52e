"""Per-choice output parsing for chat: reasoning first, then tool calls, in token order.

Each choice of a chat request owns one `ChoiceParser`: text deltas go through the reasoning
parser (`<think>...</think>` -> reasoning), then what is content goes through the tool-call
parser (`<tool_call>...</tool_call>` -> calls). Both are streaming parsers fed in the order the
tokens were generated, so the streamed events and the non-streamed message are the same fold of
one sequence, whatever the chunking. A call written inside the reasoning span is reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from serve_app.parsers.reasoning import ThinkReasoningParser, prompt_opens_reasoning
from serve_app.parsers.tools import (
    ContentDelta,
    StreamingToolParser,
    ToolCall,
    ToolCallArgsDelta,
    ToolCallStart,
    get_parser,
)

DEFAULT_TOOL_PARSER = "hermes"
# Enough prompt tokens to see whether the template left a `<think>` open.
PROMPT_TAIL = 8


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


OutputEvent = ReasoningDelta | ContentDelta | ToolCallStart | ToolCallArgsDelta


@dataclass(frozen=True)
class ParseOptions:
    """How one request's outputs are read; the same for each of its choices."""

    reasoning: bool = False  # route a `<think>` block to reasoning_content
    starts_in_reasoning: bool = False  # the prompt ends inside an open `<think>`
    tool_names: tuple[str, ...] | None = None  # None: no tool-call parsing
    # Stream argument text as generated: only where a grammar enforces well-formed calls.
    stream_arguments: bool = False
    tool_parser: str = DEFAULT_TOOL_PARSER

    @property
    def is_plain(self) -> bool:
        return not self.reasoning and self.tool_names is None


def chat_parse_options(req: Any, prompt_tail: str) -> ParseOptions:
    """A chat request's parse options. Reasoning is read unless the request turned thinking
    off (`chat_template_kwargs.enable_thinking: false`: the template pre-fills an empty block);
    calls are read unless there are no tools or `tool_choice` is `none`."""
    reasoning = req.thinking is not False
    mode = req.tool_choice_mode
    names = tuple(t["function"]["name"] for t in req.tools or ()) if mode != "none" else ()
    return ParseOptions(
        reasoning=reasoning,
        starts_in_reasoning=reasoning and prompt_opens_reasoning(prompt_tail),
        tool_names=names or None,
        stream_arguments=mode in ("required", "named"),
    )


class ChoiceParser:
    def __init__(self, options: ParseOptions) -> None:
        self.reasoning = (
            ThinkReasoningParser(True, starts_in_reasoning=options.starts_in_reasoning)
            if options.reasoning
            else None
        )
        self.tools: StreamingToolParser | None = None
        if options.tool_names is not None:
            parser_cls = get_parser(options.tool_parser)
            self.tools = parser_cls(options.tool_names, stream_arguments=options.stream_arguments)

    def feed(self, text: str) -> list[OutputEvent]:
        if self.reasoning is None:
            return self._content(text, final=False)
        chunk = self.reasoning.feed(text)
        head: list[OutputEvent] = [ReasoningDelta(chunk.reasoning)] if chunk.reasoning else []
        return head + self._content(chunk.content, final=False)

    def finish(self) -> list[OutputEvent]:
        if self.reasoning is None:
            return self._content("", final=True)
        chunk = self.reasoning.finish()
        head: list[OutputEvent] = [ReasoningDelta(chunk.reasoning)] if chunk.reasoning else []
        return head + self._content(chunk.content, final=True)

    def _content(self, text: str, *, final: bool) -> list[OutputEvent]:
        if self.tools is None:
            return [ContentDelta(text)] if text else []
        events: list[OutputEvent] = list(self.tools.feed(text)) if text else []
        if final:
            events.extend(self.tools.finish())
        return events

    @property
    def broken_call_indices(self) -> list[int]:
        return self.tools.broken_call_indices if self.tools is not None else []


@dataclass
class ChoiceMessage:
    """The fold of one choice's events: what the non-streamed message carries."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def add(self, event: OutputEvent) -> None:
        if isinstance(event, ReasoningDelta):
            self.reasoning += event.text
        elif isinstance(event, ContentDelta):
            self.content += event.text
        elif isinstance(event, ToolCallStart):
            self.tool_calls.append(ToolCall(event.id, event.name, ""))
        else:
            call = self.tool_calls[event.index]
            self.tool_calls[event.index] = replace(
                call, arguments_json=call.arguments_json + event.fragment
            )
