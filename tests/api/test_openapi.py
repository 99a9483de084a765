"""The OpenAPI document in the repository is the one the server serves."""

from __future__ import annotations

import json

from space.api.app import OPENAPI_FILE, openapi_document


def test_checked_in_openapi_matches_the_code() -> None:
    assert OPENAPI_FILE.exists(), "run: python -m space.api.openapi > docs/openapi.json"
    assert json.loads(OPENAPI_FILE.read_text()) == json.loads(openapi_document()), (
        "docs/openapi.json is stale: regenerate it with `python -m space.api.openapi`"
    )


def test_every_route_documents_its_errors_as_problems() -> None:
    doc = json.loads(openapi_document())
    paths = doc["paths"]
    assert "/v1/sandboxes" in paths and "/v1/sandboxes/{sandbox_id}/exec" in paths
    assert "/v1/sandboxes/{sandbox_id}/files" in paths
