"""The OpenAPI document reception serves at /openapi.json (services/reception/http/openapi.py): it
describes every route, with the input each one reads, so that a client or the fuzzer of
tests/e2e/test_http_fuzz.py can call them all."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from services.reception.http import create_app
from services.reception.http.files import FileUploads
from services.reception.training_uploads import UploadLimits

# The routes that read a body (every one of them must describe it).
BODIES = {
    ("post", "/v1/chat/completions"): "application/json",
    ("post", "/v1/completions"): "application/json",
    ("post", "/v1/responses"): "application/json",
    ("post", "/v1/infer"): "application/json",
    ("post", "/v1/jobs"): "application/json",
    ("post", "/v1/training/jobs"): "application/json",
    ("post", "/v1/fine_tuning/jobs"): "application/json",
    ("post", "/v1/files"): "multipart/form-data",
}


@pytest.fixture(scope="module")
def document() -> dict:
    # Nothing is called: the document comes from the routes alone.
    files = FileUploads(store=None, limits=UploadLimits(max_bytes=1024, max_per_owner=0))
    app = create_app(None, None, None, training=object(), files=files)
    answer = TestClient(app).get("/openapi.json")
    assert answer.status_code == 200, answer.text
    return answer.json()


def _operations(document: dict) -> dict[tuple[str, str], dict]:
    return {(method, path): op for path, ops in document["paths"].items() for method, op in ops.items()}


def test_every_route_that_reads_a_body_describes_it(document):
    operations = _operations(document)
    for (method, path), media_type in BODIES.items():
        body = operations[(method, path)].get("requestBody", {}).get("content", {})
        assert media_type in body and body[media_type]["schema"], (method, path, body)


def test_operation_ids_are_unique_and_refusals_are_openais_error_body(document):
    operations = _operations(document).values()
    ids = [op["operationId"] for op in operations]
    assert len(ids) == len(set(ids)), sorted(ids)
    for op in operations:
        assert "422" not in op["responses"], op["operationId"]  # reception answers 400, never FastAPI's 422
        refused = op["responses"]["4XX"]["content"]["application/json"]["schema"]
        assert refused == {"$ref": "#/components/schemas/Error"}


def test_the_parts_checked_by_hand_have_openais_shape(document):
    schemas = document["components"]["schemas"]
    tools = schemas["ChatCompletionRequest"]["properties"]["tools"]["anyOf"][0]
    assert tools["items"] == {"$ref": "#/components/schemas/FunctionTool"}
    assert schemas["FunctionTool"]["properties"]["function"]["required"] == ["name"]
    assert "tool" in schemas["Message"]["properties"]["role"]["enum"]
    files_query = {p["name"] for p in document["paths"]["/v1/files"]["get"]["parameters"]}
    assert files_query == {"after", "limit", "order", "purpose"}
