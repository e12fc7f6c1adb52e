"""What the server says it is: `/v1/server_info` and `/v1/models`."""

from __future__ import annotations

from serve_app.conformance.cases.base import case
from serve_app.conformance.observe import shape
from serve_app.conformance.record import CaseRecord
from serve_app.conformance.session import Session

ARTIFACT_HASHES = ("weights_sha256", "tokenizer_sha256", "chat_template_sha256")


@case("server-info", "/v1/server_info names the served artifact and publishes the error table")
def server_info(s: Session, record: CaseRecord) -> None:
    record.inputs["request"] = "GET /v1/server_info"
    info = s.server_info
    if info is None:
        r = s.http.get("/v1/server_info")
        record.unsupported(f"GET /v1/server_info: HTTP {r.status_code}", r.text[:500])
    artifact = info.get("artifact") or {}
    missing = [k for k in ARTIFACT_HASHES if not artifact.get(k)]
    record.check(not missing, f"artifact hashes missing: {missing}")
    taxonomy = info.get("errors") or []
    record.check(bool(taxonomy), "no error table (errors)")
    codes = sorted({code for row in taxonomy for code in row.get("codes", [])})
    statuses = sorted({status for row in taxonomy for status in row.get("status", [])})
    # Two levels of paths: what the document holds, not each profile's or limit's name.
    paths = sorted({".".join(p.split(".")[:2]) for p in shape(info)})
    record.outputs.update(shape=paths, error_codes=codes, error_statuses=statuses)
    record.outputs["parameter_policy"] = info.get("parameter_policy")


@case("models-list", "/v1/models lists the served model in the OpenAI shape")
def models_list(s: Session, record: CaseRecord) -> None:
    record.inputs["request"] = "GET /v1/models"
    r = s.http.get("/v1/models")
    record.check(r.status_code == 200, f"HTTP {r.status_code}")
    data = r.json() if r.status_code == 200 else {}
    record.check(data.get("object") == "list", f"object {data.get('object')!r}")
    ids = [m.get("id") for m in data.get("data") or []]
    record.check(s.model in ids, f"{s.model!r} not among {ids}")
    record.check(
        all(m.get("object") == "model" for m in data.get("data") or []), "an entry not a model"
    )
    record.outputs["shape"] = shape(data)
