"""Chat templates given with `--chat-template FILE`, the ones shipped in this package, and
whether a template can render `tools` at all (decided once, at startup)."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

CHECKPOINT_LABEL = "the checkpoint's own"
# A tool no template would name by accident: a template that renders tools prints its name.
_PROBE_TOOL_NAME = "serve_app_tool_probe_3f9c"
_PROBE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": _PROBE_TOOL_NAME,
            "description": "probe",
            "parameters": {"type": "object", "properties": {}},
        },
    }
]


@dataclass(frozen=True)
class ChatTemplate:
    """The template a server renders with: its text and how a message names it."""

    text: str | None
    # `--chat-template`'s file name, or CHECKPOINT_LABEL.
    label: str


def shipped_template_path(name: str) -> Path:
    """A template file that ships with this package (e.g. `smollm2_tools.jinja`)."""
    path = Path(str(resources.files("serve_app.checkpoints").joinpath(name)))
    if not path.is_file():
        raise ValueError(f"chat_template: no shipped template named {name!r}")
    return path


def load_chat_template(path: str | Path) -> str:
    """The template file's text, checked to parse as Jinja: a broken template fails at start,
    naming the file and line, not at the first request."""
    from jinja2 import TemplateSyntaxError

    # NOTE: transformers' own compiler (private, but it is the environment, extensions and
    # filters that every request renders with), so what parses here renders there.
    from transformers.utils.chat_template_utils import _compile_jinja_template

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"chat_template: cannot read {path}: {exc}") from None
    if not text.strip():
        raise ValueError(f"chat_template: {path} is empty")
    try:
        _compile_jinja_template(text)
    except TemplateSyntaxError as exc:
        raise ValueError(f"chat_template: {path} line {exc.lineno}: {exc.message}") from None
    return text


def resolve_chat_template(path: str | Path | None, checkpoint_template: str | None) -> ChatTemplate:
    """The template in effect: the `--chat-template` file if given, else the checkpoint's."""
    if path is None:
        return ChatTemplate(checkpoint_template, CHECKPOINT_LABEL)
    return ChatTemplate(load_chat_template(path), Path(path).name)


def renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template writes `tools` into the prompt: a probe
    conversation with one tool, rendered, must contain the tool's name. Many templates (SmolLM2's
    among them) ignore `tools` silently; a request's tools must then be refused, not dropped."""
    if not tokenizer.chat_template:
        return False
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Which tools do you have?"}],
            tools=_PROBE_TOOLS,
            tokenize=False,
            add_generation_prompt=True,
        )
    except Exception:  # noqa: BLE001 (a template that cannot take tools does not render them)
        return False
    return _PROBE_TOOL_NAME in str(text)


def tools_unsupported_reason(template: ChatTemplate) -> str:
    return (
        f"the chat template in use ({template.label}) does not render tools, so they would be "
        "silently dropped; serve with --chat-template FILE naming a template that renders them"
    )
