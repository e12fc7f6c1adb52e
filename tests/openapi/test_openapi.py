"""The OpenAPI documents: valid OpenAPI 3.1, generated from the parsing models, covering every
route the apps serve; the admin port's behind the admin key. No Ray, no model."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from serve_app.openapi.admin import admin_document
from serve_app.openapi.public import public_document
from serve_app.protocol import MAX_N, ChatCompletionRequest

METHODS = {"GET", "POST", "DELETE", "PUT", "PATCH"}


def _assert_valid_openapi_31(doc: dict[str, Any]) -> None:
    import schemathesis

    assert doc["openapi"].startswith("3.1.")
    schema = schemathesis.openapi.from_dict(doc)
    schema.validate()  # the OpenAPI 3.1 meta-schema
    for component in doc["components"]["schemas"].values():
        Draft202012Validator.check_schema(component)
    # Every operation loads: its refs resolve, its parameters and bodies are well formed.
    for result in schema.get_all_operations():
        result.ok()


def _documented(doc: dict[str, Any]) -> set[tuple[str, str]]:
    return {(m.upper(), path) for path, item in doc["paths"].items() for m in item}


def _served(app: Any) -> set[tuple[str, str]]:
    # Starlette's `{name:path}` convertor is OpenAPI's plain `{name}`.
    return {
        (method, route.path.replace(":path}", "}"))
        for route in app.routes
        for method in route.methods & METHODS
    }


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    from serve_app.config.options import ServeConfig
    from serve_app.config.profiles import GenerationOptions, Profile

    model = tmp_path_factory.mktemp("model")
    (model / "config.json").write_text("{}")
    generations = GenerationOptions(
        data_dir=str(tmp_path_factory.mktemp("data")),
        profiles=(Profile(name="triage"),),
    )
    return ServeConfig(model=str(model), generations=generations)


def _public_app(config) -> Any:
    """The ingress' Starlette app, its handlers stubbed (routes and middleware are real)."""
    from serve_app.generations.conversations import ConversationsAPI
    from serve_app.generations.routes import GenerationsAPI
    from serve_app.ingress import Ingress
    from serve_app.responses.routes import ResponsesAPI

    def handler(request):  # never called: only the route table is read
        raise AssertionError

    conversations = SimpleNamespace(
        create=handler, get=handler, update=handler, delete=handler, list_items=handler,
        create_items=handler, get_item=handler, delete_item=handler,
    )  # fmt: skip
    conversations.routes = lambda: ConversationsAPI.routes(conversations)
    generations = SimpleNamespace(
        create=handler, get=handler, cancel=handler, conversations=conversations
    )
    generations.routes = lambda: GenerationsAPI.routes(generations)
    responses = SimpleNamespace(
        create=handler, get=handler, delete=handler, input_items=handler, cancel=handler
    )
    responses.routes = lambda: ResponsesAPI.routes(responses)
    ingress = SimpleNamespace(
        config=config,
        health=handler,
        models=handler,
        server_info=handler,
        openai=SimpleNamespace(chat=handler, completions=handler),
        generations=generations,
        responses=responses,
    )
    return Ingress.__serve_build_asgi_app__(ingress)


@pytest.mark.parametrize("keyed", [False, True])
def test_public_document_is_valid_openapi_31(keyed):
    _assert_valid_openapi_31(public_document(model_ids=["m"], profiles=["p"], keyed=keyed))


@pytest.mark.parametrize("keyed", [False, True])
def test_admin_document_is_valid_openapi_31(keyed):
    _assert_valid_openapi_31(admin_document(keyed=keyed))


def test_public_document_covers_every_route_the_ingress_serves(config):
    from serve_app.openapi.public import config_document

    assert _documented(config_document(config)) == _served(_public_app(config))


def test_admin_document_covers_every_admin_route():
    from serve_app.ops.admin_app import build_admin_app

    app = build_admin_app(registry=None, api_key=None)
    assert _documented(admin_document(keyed=False)) == _served(app)


def test_request_schemas_are_the_parsing_models_with_this_servers_values(config):
    from serve_app.openapi.public import config_document

    schemas = config_document(config)["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]
    # pydantic's own schema of the model the route parses with: same fields, same bounds.
    expected = ChatCompletionRequest.model_json_schema()["properties"]
    assert set(expected) - {"model"} <= set(chat["properties"])
    assert chat["additionalProperties"] is False
    (n_int,) = [s for s in chat["properties"]["n"]["anyOf"] if s.get("type") == "integer"]
    assert n_int["maximum"] == MAX_N
    # What the model leaves open, the server names: its model id and profiles.
    assert chat["properties"]["model"]["enum"] == [config.model_id]
    assert schemas["GenerationCreate"]["properties"]["profile"]["enum"] == ["triage"]
    # Accepted-and-ignored fields are declared, so a client may send them.
    assert {"user", "metadata", "store", "service_tier"} <= set(chat["properties"])


def test_every_error_status_answers_with_the_one_error_shape_and_retry_headers():
    doc = public_document(keyed=True)
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    statuses = set()
    for item in doc["paths"].values():
        for op in item.values():
            for status, reply in op["responses"].items():
                if int(status) < 400:
                    continue
                statuses.add(int(status))
                assert reply["content"]["application/json"]["schema"] == error_ref
                assert "x-should-retry" in reply["headers"]
                assert ("Retry-After" in reply["headers"]) == (int(status) in (429, 503))
    assert {400, 401, 403, 404, 409, 413, 422, 429, 500, 503} <= statuses
    detail = doc["components"]["schemas"]["ErrorDetail"]
    assert set(detail["required"]) == {"message", "type", "code", "param"}


def test_streaming_replies_are_documented_as_server_sent_events():
    doc = public_document()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/generations", "/v1/responses"):
        content = doc["paths"][path]["post"]["responses"]["200"]["content"]
        assert {"application/json", "text/event-stream"} <= set(content)


def test_security_scheme_only_on_a_keyed_server_and_health_stays_open():
    keyed, open_ = public_document(keyed=True), public_document(keyed=False)
    assert keyed["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert keyed["security"] == [{"bearer": []}]
    assert keyed["paths"]["/health"]["get"]["security"] == []
    assert "401" in keyed["paths"]["/v1/models"]["get"]["responses"]
    assert "securitySchemes" not in open_["components"] and "security" not in open_
    assert all("401" not in op["responses"] for i in open_["paths"].values() for op in i.values())


class _Registry:
    """The live registry the admin routes call (two of its methods), without Ray."""

    def __init__(self) -> None:
        self.draining = False
        self.snapshot = SimpleNamespace(remote=self._snapshot)
        self.set_draining = SimpleNamespace(remote=self._set)

    async def _snapshot(self) -> dict[str, Any]:
        return {"replicas": [], "total": {}, "draining": self.draining}

    async def _set(self, draining: bool) -> bool:
        self.draining = draining
        return draining

    async def call(self, method):
        # As serve_app.ops.stats.RegistryHandle: the routes name the method, the registry calls it.
        return await method(self)


def test_admin_openapi_needs_the_admin_key_and_drain_parses_with_its_model():
    from starlette.testclient import TestClient

    from serve_app.ops.admin_app import build_admin_app

    registry = _Registry()
    client = TestClient(build_admin_app(registry, api_key="sekrit"))
    assert client.get("/openapi.json").status_code == 401
    doc = client.get("/openapi.json", headers={"Authorization": "Bearer sekrit"}).json()
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    auth = {"Authorization": "Bearer sekrit"}
    # The body the document declares is the one the route parses: a string is no bool.
    bad = client.post("/admin/v1/drain", json={"draining": "no"}, headers=auth)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "draining"
    assert registry.draining is False
    assert client.post("/admin/v1/drain", headers=auth).json()["draining"] is True
    lifted = client.post("/admin/v1/drain", json={"draining": False}, headers=auth)
    assert lifted.json()["draining"] is False


def test_the_module_prints_a_document_without_a_server():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "serve_app.openapi", "--keyed"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    doc = json.loads(out)
    assert doc["security"] == [{"bearer": []}] and "/v1/generations" in doc["paths"]


def _sse_response(case: Any, events: list[str]) -> Any:
    import requests
    import schemathesis

    body = "".join(f"data: {e}\n\n" for e in events).encode()
    request = requests.Request("POST", "http://127.0.0.1:1/v1/chat/completions", json=case.body)
    return schemathesis.Response(
        status_code=200,
        headers={"content-type": ["text/event-stream"]},
        content=body,
        request=request.prepare(),
        elapsed=0.0,
        message="OK",
        encoding="utf-8",
        http_version="1.1",
        verify=True,
    )


def test_stream_schema_takes_the_servers_chunks_and_refuses_a_malformed_one():
    import schemathesis
    from schemathesis.checks import response_schema_conformance
    from schemathesis.core.failures import FailureGroup

    from serve_app.errors import internal_error
    from serve_app.protocol import ChatChunkChoice, ChatCompletionChunk, DeltaMessage

    schema = schemathesis.openapi.from_dict(public_document(model_ids=["m"]))
    case = schema["/v1/chat/completions"]["POST"].Case(
        body={"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    )
    role = DeltaMessage(role="assistant", content="")
    chunk = ChatCompletionChunk(id="c", model="m", choices=[ChatChunkChoice(index=0, delta=role)])
    frame = json.dumps(internal_error("The stream failed.").body())
    served = [json.dumps(chunk.to_dict()), frame, "[DONE]"]
    checks = [response_schema_conformance]
    case.validate_response(_sse_response(case, served), checks=checks)
    no_choices = {k: v for k, v in chunk.to_dict().items() if k != "choices"}
    for events in ([json.dumps(no_choices), "[DONE]"], ["not json"]):
        with pytest.raises(FailureGroup):
            case.validate_response(_sse_response(case, events), checks=checks)


def test_a_keyed_server_serves_its_document_to_key_holders_only(config):
    from starlette.testclient import TestClient

    from serve_app.access.keys import KeysFile, hash_key

    keys = KeysFile.model_validate(
        {"keys": [{"id": "k", "sha256": hash_key("key-a"), "tenant": "a"}]}
    )
    client = TestClient(_public_app(config.model_copy(update={"api_keys": keys})))
    refused = client.get("/openapi.json")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    doc = client.get("/openapi.json", headers={"Authorization": "Bearer key-a"}).json()
    assert doc["security"] == [{"bearer": []}]
    assert doc["paths"]["/v1/chat/completions"]["post"]["responses"]["401"]
