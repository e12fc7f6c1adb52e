"""The ingress replica stays light: after requests that exercise every grammar path (a forced
tool call, a schema after the reasoning span), it has imported neither torch nor xgrammar nor
transformers. Specs are built in the ingress; the grammar deployment converts and compiles
them (serve_app/grammar/convert.py); token texts are read with `tokenizers`."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.serve

ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "required": ["city"],
            "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 8}},
        },
    },
}
SCHEMA = {"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}}


def _ingress_modules(names: tuple[str, ...]) -> list[dict[str, bool]]:
    """In every ingress replica of the session's app: which of `names` it has imported."""
    import ray

    def loaded(replica: Any, names: tuple[str, ...]) -> dict[str, bool]:
        import sys

        return {name: name in sys.modules for name in names}

    actors = ray.util.list_named_actors(all_namespaces=True)
    replicas = [
        ray.get_actor(a["name"], namespace=a["namespace"])
        for a in actors
        if a["name"].startswith("SERVE_REPLICA::") and "#ingress#" in a["name"]
    ]
    assert replicas, [a["name"] for a in actors]
    return ray.get([r.__ray_call__.remote(loaded, names) for r in replicas])


def test_the_ingress_replica_never_imports_torch(client, model_id):
    """Forced calls, a schema after the reasoning span and a grammar: every spec is built in
    the ingress, converted and compiled by the grammar deployment. The ingress stays light."""
    client.chat.completions.create(
        model=model_id, messages=ASK, max_tokens=8, tools=[WEATHER], tool_choice="required"
    )
    client.chat.completions.create(
        model=model_id,
        messages=ASK,
        max_tokens=8,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}},
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    for replica in _ingress_modules(("torch", "xgrammar", "transformers", "serve_app.ingress")):
        assert replica == {
            "torch": False, "xgrammar": False, "transformers": False, "serve_app.ingress": True,
        }  # fmt: skip
