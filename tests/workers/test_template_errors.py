"""The tokenizer deployment's template errors, in-process: a request's kwargs can only set
template variables, and a template that raises blames the part of the request that broke it."""

from __future__ import annotations

import pytest

from serve_app import errors
from serve_app.workers.tokenizer import TokenizerService

# Raises on a kwarg (strict_roles) or on a message (a tool turn); renders otherwise.
STRICT_TEMPLATE = (
    "{%- if strict_roles is defined and strict_roles -%}"
    "{{ raise_exception('strict roles are on') }}{%- endif -%}"
    "{%- for m in messages -%}{%- if m.role == 'tool' -%}"
    "{{ raise_exception('no tool turns') }}{%- endif -%}{{ m.content }}{%- endfor -%}"
)
USER = [{"role": "user", "content": "hi"}]
TOOL = [{"role": "tool", "content": "42", "tool_call_id": "c1"}]


@pytest.fixture(scope="module")
def service(model_dirs) -> TokenizerService:
    svc = TokenizerService(str(model_dirs("llama")))
    svc.tokenizer.chat_template = STRICT_TEMPLATE
    return svc


def _refusal(service: TokenizerService, messages, kwargs) -> errors.APIError:
    with pytest.raises(errors.APIError) as info:
        service.render_chat(messages, chat_template_kwargs=kwargs)
    assert (info.value.status, info.value.code) == (400, "invalid_request")
    return info.value


def test_kwargs_that_break_the_template_are_blamed(service: TokenizerService) -> None:
    err = _refusal(service, USER, {"strict_roles": True})
    assert err.param == "chat_template_kwargs" and "strict roles are on" in err.message
    # The same kwargs with acceptable values render.
    assert service.render_chat(USER, chat_template_kwargs={"strict_roles": False})


def test_messages_that_break_the_template_are_blamed(service: TokenizerService) -> None:
    for kwargs in (None, {"strict_roles": False}):
        err = _refusal(service, TOOL, kwargs)
        assert err.param == "messages" and "no tool turns" in err.message


@pytest.mark.parametrize("name", ["chat_template", "tokenize", "return_dict", "messages", "tools"])
def test_kwargs_cannot_set_arguments_of_the_template_call(
    service: TokenizerService, name: str
) -> None:
    # `chat_template` would let a request bring its own template.
    err = _refusal(service, USER, {name: "{{ 'owned' }}"})
    assert err.param == f"chat_template_kwargs.{name}"
