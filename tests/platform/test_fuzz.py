"""Hostile input on every endpoint of the OpenAPI document: the answer is never a 5xx.

A property-based run: for each operation, hypothesis generates path ids, query values and JSON
bodies that are mostly wrong (wrong types, huge and odd strings, nested junk, missing and extra
fields) and sometimes right. Any 5xx, or an error that is not problem+json, fails the test.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from space.api.app import OPENAPI_FILE

from ..stack import Platform
from .helpers import create

pytestmark = pytest.mark.vm

DOC = json.loads(OPENAPI_FILE.read_text())
OPERATIONS = [
    (method.upper(), path)
    for path, item in DOC["paths"].items()
    for method in item
    if method in ("get", "post", "put", "delete")
]

text = st.one_of(
    st.text(max_size=40),
    st.sampled_from(
        [
            "",
            "/",
            "..",
            "../../etc/passwd",
            "%00",
            "\x00",
            "🙂" * 50,
            "a" * 5000,
            "-1",
            "1e309",
            "null",
            "true",
            "[]",
            "{}",
            "/root",
            "/etc/hostname",
        ]
    ),
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    text,
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(text, inner, max_size=4)),
    max_leaves=12,
)
field_names = st.sampled_from(
    ["cmd", "argv", "env", "cwd", "user", "timeout", "stdin", "pty", "template", "vcpus",
     "memory_mib", "disk_mib", "timeout_s", "timeout_action", "metadata", "id", "rows", "cols"]
)  # fmt: skip
bodies = st.one_of(
    st.dictionaries(st.one_of(field_names, text), json_values, max_size=6), json_values
)
queries = st.dictionaries(
    st.sampled_from(
        [
            "path",
            "wait",
            "limit",
            "cursor",
            "state",
            "template",
            "mode",
            "make_parents",
            "recursive",
            "parents",
            "metadata.k",
        ]
    ),
    st.one_of(text, st.integers().map(str)),
    max_size=4,
)


@pytest.fixture(scope="module")
def live_id(platform: Platform) -> str:
    with platform.client() as c:
        return str(create(c)["id"])


@pytest.mark.parametrize(("method", "path"), OPERATIONS)
def test_no_input_makes_a_server_error(
    platform: Platform, live_id: str, method: str, path: str
) -> None:
    client = platform.client()

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        sandbox_id=st.one_of(
            st.just(live_id), text.filter(lambda s: s.isprintable() and "/" not in s and s)
        ),
        query=queries,
        body=bodies,
    )
    def fuzz(sandbox_id: str, query: dict[str, str], body: Any) -> None:
        if method == "POST" and path == "/v1/sandboxes" and isinstance(body, dict):
            body = {**body, "surprise": 1}  # never valid: creating VMs is not what is fuzzed
        if method == "DELETE" and sandbox_id == live_id and path.endswith("{sandbox_id}"):
            return  # deleting the shared sandbox would end the run's other cases early
        url = path.replace("{sandbox_id}", quote(sandbox_id, safe=""))
        try:
            # Streamed: a valid watch or follow never ends, so a success is judged by its head.
            with client.stream(method, url, params=query, json=body, timeout=60) as r:
                if r.status_code >= 400:
                    r.read()
        except httpx.TransportError as e:
            raise AssertionError(f"{method} {url} broke the connection: {e}") from e
        assert r.status_code < 500, (method, url, query, body, r.status_code, r.text[:300])
        if r.status_code >= 400:
            assert r.headers["content-type"] == "application/problem+json", (method, url)

    try:
        fuzz()
    finally:
        client.close()
