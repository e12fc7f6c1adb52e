"""The ChatML chat template shipped with factory-built checkpoints.

Hermes / Qwen2.5 conventions, so parsers written against those models work unchanged:
tools are listed as JSON lines inside `<tools></tools>` in the system turn, the assistant calls
them with `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, and tool results come back
as a user turn wrapping each result in `<tool_response></tool_response>`. `enable_thinking=False`
pre-fills an empty `<think>` block, as Qwen3 does, so the model starts on the answer.
"""

from __future__ import annotations

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

TOOLS_PREAMBLE = (
    "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_INSTRUCTION = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)

# The prompt texts stay Python constants so parsers and tests can refer to them; they are spliced
# into single-quoted Jinja literals. `tojson` in transformers keeps key order and non-ASCII text.
# Content may be a string, None (an assistant turn that only calls tools) or a list of OpenAI
# content parts, of which only text parts render.
_TEMPLATE = r"""
{%- macro render_content(content) -%}
    {%- if content is none -%}
    {%- elif content is string -%}{{- content -}}
    {%- else -%}
        {%- for part in content -%}
            {%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if messages and messages[0].role == 'system' -%}
    {%- set system_text = render_content(messages[0].content) -%}
    {%- set rest = messages[1:] -%}
{%- else -%}
    {%- set system_text = none -%}
    {%- set rest = messages -%}
{%- endif -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {{- system_text if system_text is not none else '@DEFAULT_SYSTEM_PROMPT@' -}}
    {{- '@TOOLS_PREAMBLE@' -}}
    {%- for tool in tools -%}
        {{- '\n' -}}{{- tool | tojson -}}
    {%- endfor -%}
    {{- '@TOOLS_INSTRUCTION@' -}}
    {{- '<|im_end|>\n' -}}
{%- elif system_text is not none -%}
    {{- '<|im_start|>system\n' + system_text + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in rest -%}
    {%- if message.role == 'tool' -%}
        {%- if loop.first or loop.previtem.role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' + render_content(message.content) + '\n</tool_response>' -}}
        {%- if loop.last or loop.nextitem.role != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- elif message.role == 'assistant' -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if message.reasoning_content -%}
            {{- '<think>\n' + message.reasoning_content + '\n</think>\n\n' -}}
        {%- endif -%}
        {%- set text = render_content(message.content) -%}
        {{- text -}}
        {%- for call in message.tool_calls or [] -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {%- if text or not loop.first -%}{{- '\n' -}}{%- endif -%}
            {{- '<tool_call>\n{"name": ' + (fn.name | tojson) + ', "arguments": ' -}}
            {%- if fn.arguments is string -%}
                {{- fn.arguments -}}
            {%- else -%}
                {{- fn.arguments | tojson -}}
            {%- endif -%}
            {{- '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- else -%}
        {{- '<|im_start|>' + message.role + '\n' + render_content(message.content) -}}
        {{- '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- endif -%}
{%- endif -%}
"""


def _jinja_literal(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("'", "\\'")


CHAT_TEMPLATE = (
    _TEMPLATE.strip()
    .replace("@DEFAULT_SYSTEM_PROMPT@", _jinja_literal(DEFAULT_SYSTEM_PROMPT))
    .replace("@TOOLS_PREAMBLE@", _jinja_literal(TOOLS_PREAMBLE))
    .replace("@TOOLS_INSTRUCTION@", _jinja_literal(TOOLS_INSTRUCTION))
)
