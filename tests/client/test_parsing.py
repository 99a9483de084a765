"""The SDK's pure parts: errors from problem documents, the exec stream decoder, models, request
building, credentials resolution and the CLI's argument checks. Nothing here talks to a server;
the SDK against the real stack is tested end to end elsewhere."""

from __future__ import annotations

import base64
import builtins
import json
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

import space
from space.cli.main import cli
from space.client import _calls as calls
from space.client._config import (
    DEFAULT_API_URL,
    Credentials,
    credentials_path,
    resolve_credentials,
    save_credentials,
)
from space.client._errors import (
    APIError,
    AuthenticationError,
    ConflictError,
    ConnectionError,
    ExecError,
    NotFoundError,
    SpaceError,
    ValidationError,
    error_from_response,
    transport_errors,
)
from space.client._exec import ExecDecoder, ExecStreamBase, OutputCollector, ws_output
from space.client._models import Event, ExecResult, FileEntry, SandboxInfo

SANDBOX = {
    "id": "sb-0123456789abcdef",
    "state": "running",
    "desired_state": "running",
    "reason": None,
    "template": "base",
    "vcpus": 1,
    "memory_mib": 256,
    "disk_mib": 1024,
    "timeout_s": 300,
    "timeout_action": "pause",
    "expires_at": "2026-12-02T11:05:00Z",
    "env": {"K": "V"},
    "metadata": {"team": "a"},
    "worker_id": "w1",
    "created_at": "2026-12-02T11:00:00.123456Z",
    "updated_at": "2026-12-02T11:00:01+00:00",
}


def _problem(status: int, /, **body: Any) -> Any:
    headers = {"content-type": "application/problem+json"}
    return error_from_response(httpx.Response(status, json=body, headers=headers))


# Errors


def test_not_found_carries_the_detail() -> None:
    e = _problem(404, type="about:blank", title="Not Found", status=404, detail="no sandbox sb-x")
    assert type(e) is NotFoundError
    assert (e.status, e.title, e.detail) == (404, "Not Found", "no sandbox sb-x")
    assert str(e) == "404 Not Found: no sandbox sb-x"


def test_conflict_carries_the_state() -> None:
    e = _problem(409, title="Conflict", detail="sandbox sb-x is paused", state="paused")
    assert isinstance(e, ConflictError)
    assert e.state == "paused"
    assert "sandbox sb-x is paused" in str(e)


@pytest.mark.parametrize("status", [400, 422])
def test_validation_errors_list_what_was_wrong(status: int) -> None:
    errors = [{"loc": ["body", "vcpus"], "msg": "Input should be less than or equal to 16"}]
    e = _problem(status, title="Unprocessable Content", detail="invalid request", errors=errors)
    assert isinstance(e, ValidationError)
    assert e.errors == errors
    assert "body.vcpus: Input should be less than or equal to 16" in str(e)


def test_validation_problems_are_not_repeated_when_the_detail_has_them() -> None:
    detail = "body.vcpus: too big"
    e = _problem(
        422,
        title="Unprocessable Content",
        detail=detail,
        errors=[{"loc": ["body", "vcpus"], "msg": "too big"}],
    )
    assert str(e).count(detail) == 1


def test_authentication_error_says_where_the_key_comes_from() -> None:
    e = _problem(401, title="Unauthorized", detail="invalid API key")
    assert isinstance(e, AuthenticationError)
    assert "SPACE_API_KEY" in str(e) and "invalid API key" in str(e)


def test_other_statuses_are_plain_api_errors() -> None:
    e = _problem(507, title="Insufficient Storage", detail="no room on any worker")
    assert type(e) is APIError
    assert isinstance(e, SpaceError)
    assert str(e) == "507 Insufficient Storage: no room on any worker"


def test_a_body_that_is_not_a_problem_becomes_the_detail() -> None:
    response = httpx.Response(502, text="<html>Bad Gateway from the proxy</html>\n")
    e = error_from_response(response)
    assert type(e) is APIError
    assert (e.status, e.title) == (502, "Bad Gateway")
    assert e.detail == "<html>Bad Gateway from the proxy</html>"


def test_an_unknown_status_still_has_a_title() -> None:
    e = error_from_response(httpx.Response(599, content=b""))
    assert (e.status, e.title) == (599, "Error")


def test_transport_failures_become_connection_errors() -> None:
    refused = pytest.raises(ConnectionError, match="cannot talk to the SPACE API at http://h:1")
    with refused as info, transport_errors("http://h:1"):
        raise httpx.ConnectError("connection refused")
    # Code catching the standard exception catches ours too.
    assert isinstance(info.value, builtins.ConnectionError)
    with pytest.raises(ConnectionError, match="did not answer in time"), transport_errors("h"):
        raise httpx.ReadTimeout("timed out")


# The exec stream


def _line(event: dict[str, Any]) -> bytes:
    return json.dumps(event).encode() + b"\n"


def _out(stream: str, data: bytes) -> bytes:
    return _line({"type": stream, "data": base64.b64encode(data).decode()})


EXIT = {"type": "exit", "exit_code": 3, "signal": None, "timed_out": False, "duration_ms": 12.5}

outputs = st.lists(st.tuples(st.sampled_from(["stdout", "stderr"]), st.binary(max_size=300)))


@given(outputs, st.lists(st.integers(1, 200), min_size=1, max_size=30))
def test_ndjson_decodes_through_any_split(items: list[tuple[str, bytes]], cuts: list[int]) -> None:
    body = _line({"type": "start", "pid": 42})
    body += b"".join(_out(s, d) for s, d in items) + _line(EXIT)
    decoder = ExecDecoder()
    got = []
    pos = i = 0
    while pos < len(body):
        n = cuts[i % len(cuts)]
        got += decoder.feed(body[pos : pos + n])
        pos, i = pos + n, i + 1
    got += decoder.end()
    assert got == items
    assert decoder.pid == 42
    assert decoder.result == ExecResult(3, None, False, b"", b"", 12.5)


def test_the_last_line_needs_no_newline() -> None:
    decoder = ExecDecoder()
    body = _out("stdout", b"hi") + json.dumps(EXIT).encode()
    assert decoder.feed(body) == [("stdout", b"hi")]
    assert decoder.result is None
    assert decoder.end() == []
    assert decoder.result is not None and decoder.result.exit_code == 3


def test_a_stream_without_exit_is_a_broken_connection() -> None:
    decoder = ExecDecoder()
    decoder.feed(_line({"type": "start", "pid": 1}) + _out("stdout", b"partial"))
    with pytest.raises(ConnectionError, match="ended before the process exited"):
        decoder.end()


def test_an_error_event_raises_exec_error() -> None:
    decoder = ExecDecoder()
    with pytest.raises(ExecError) as info:
        decoder.feed(_line({"type": "error", "code": "not_found", "message": "no such file"}))
    assert (info.value.code, info.value.message) == ("not_found", "no such file")
    assert "not_found" in str(info.value) and "no such file" in str(info.value)


def test_unknown_events_are_skipped_and_garbage_is_an_error() -> None:
    decoder = ExecDecoder()
    assert decoder.feed(_line({"type": "progress", "x": 1}) + b"\n  \n") == []
    with pytest.raises(SpaceError, match="malformed exec stream line"):
        decoder.feed(b"<html>\n")


def test_killed_by_a_signal() -> None:
    decoder = ExecDecoder()
    decoder.feed(
        _line(
            {
                "type": "exit",
                "exit_code": None,
                "signal": 9,
                "timed_out": True,
                "duration_ms": 1000.0,
            }
        )
    )
    result = decoder.end() and decoder.result
    assert decoder.result is not None
    assert (decoder.result.exit_code, decoder.result.signal) == (None, 9)
    assert decoder.result.timed_out and not decoder.result.ok
    assert result == []


def test_websocket_output_is_tagged_by_its_first_byte() -> None:
    assert ws_output(b"\x01hello") == ("stdout", b"hello")
    assert ws_output(b"\x02") == ("stderr", b"")
    for bad in (b"", b"\x03x", b"{"):
        with pytest.raises(SpaceError):
            ws_output(bad)


def test_the_collector_joins_output_and_calls_back() -> None:
    seen: list[bytes] = []
    collector = OutputCollector(seen.append, None)
    for stream, data in [("stdout", b"a"), ("stderr", b"e"), ("stdout", b"b")]:
        collector.add(stream, data)  # type: ignore[arg-type]
    result = collector.result(ExecResult(0, None, False, b"", b"", 1.0))
    assert (result.stdout, result.stderr, seen) == (b"ab", b"e", [b"a", b"b"])
    assert result.ok and result.text == "ab"


def test_the_result_is_only_there_at_the_end() -> None:
    with pytest.raises(SpaceError, match="has not finished"):
        _ = ExecStreamBase().result


def test_text_replaces_undecodable_bytes() -> None:
    assert ExecResult(0, None, False, b"caf\xc3\xa9 \xff", b"", 1.0).text == "café \ufffd"


# Models


def test_sandbox_info_parses_every_field() -> None:
    info = SandboxInfo.from_json(SANDBOX)
    assert info.id == "sb-0123456789abcdef"
    assert info.created_at == datetime(2026, 12, 2, 11, 0, 0, 123456, tzinfo=UTC)
    assert info.updated_at == datetime(2026, 12, 2, 11, 0, 1, tzinfo=UTC)
    assert info.expires_at == datetime(2026, 12, 2, 11, 5, tzinfo=UTC)
    assert (info.env, info.metadata, info.worker_id) == ({"K": "V"}, {"team": "a"}, "w1")
    deleted = SandboxInfo.from_json(
        {**SANDBOX, "state": "deleted", "expires_at": None, "worker_id": None, "reason": "asked"}
    )
    assert (deleted.expires_at, deleted.worker_id, deleted.reason) == (None, None, "asked")


def test_file_entries_and_events_parse() -> None:
    entry = FileEntry.from_json(
        {
            "name": "x",
            "path": "/tmp/x",
            "type": "directory",
            "size": 4096,
            "mode": 0o755,
            "uid": 0,
            "gid": 0,
            "mtime": 1700000000.5,
        }
    )
    assert entry.is_dir and entry.target is None
    assert entry.mtime == datetime(2023, 11, 14, 22, 13, 20, 500000, tzinfo=UTC)
    event = Event.from_json(
        {
            "id": 7,
            "at": "2026-12-02T11:00:00Z",
            "type": "state",
            "from_state": "starting",
            "to_state": "running",
            "reason": None,
        }
    )
    assert (event.id, event.to_state, event.at.year) == (7, "running", 2026)


# Requests


def test_create_sends_only_what_was_given() -> None:
    call = calls.create(
        {
            "vcpus": 2,
            "template": None,
            "env": {"A": "1"},
            "id": "my-box",
            "idempotency_key": "k1",
            "wait": False,
        }
    )
    assert (call.method, call.path) == ("POST", "/v1/sandboxes")
    assert call.body == {"vcpus": 2, "env": {"A": "1"}, "id": "my-box"}
    assert call.headers == {"Idempotency-Key": "k1"}
    assert list(call.params) == [("wait", "false")]
    assert calls.create({}).body == {} and list(calls.create({}).params) == [("wait", "true")]


def test_listing_filters_and_follows_the_cursor() -> None:
    pages = calls.Pages({"state": "running", "metadata": {"team": "a b", "x": "1"}})
    first = pages.next_call()
    assert first is not None
    assert ("state", "running") in first.params and ("metadata.team", "a b") in first.params
    assert ("metadata.x", "1") in first.params
    assert not any(name == "cursor" for name, _ in first.params)
    page = httpx.Response(200, json={"items": [SANDBOX], "next_cursor": "c2"})
    assert [i.id for i in first.answer(page)] == [SANDBOX["id"]]
    second = pages.next_call()
    assert second is not None and ("cursor", "c2") in second.params
    second.answer(httpx.Response(200, json={"items": [], "next_cursor": None}))
    assert pages.next_call() is None


def test_exec_bodies() -> None:
    assert calls.exec_body("ls | wc -l", {}) == {"cmd": "ls | wc -l"}
    body = calls.exec_body(
        ["ls", "-l"],
        {"cwd": "/tmp", "user": None, "stdin": "hé", "env": {"A": "1"}, "timeout": 2.5},
    )
    assert body == {
        "argv": ["ls", "-l"],
        "cwd": "/tmp",
        "env": {"A": "1"},
        "timeout": 2.5,
        "stdin": base64.b64encode("hé".encode()).decode(),
    }


def test_ids_and_paths_cannot_escape_their_place() -> None:
    call = calls.stat("../etc", "/a b?c")
    assert call.path == "/v1/sandboxes/..%2Fetc/files/stat"
    request = call.request(httpx.Client(base_url="http://api"))
    assert request.url.params["path"] == "/a b?c"


def test_an_answer_of_the_wrong_shape_is_a_clear_error() -> None:
    with pytest.raises(SpaceError, match="unexpected answer to GET /v1/sandboxes/sb-x"):
        calls.get("sb-x").answer(
            httpx.Response(200, json={"id": "sb-x"}, request=httpx.Request("GET", "http://h"))
        )


def test_uploads_accept_bytes_text_files_and_iterables(tmp_path: Path) -> None:
    assert calls.upload_content("é") == "é".encode()
    f = tmp_path / "f"
    f.write_bytes(b"x" * (calls.CHUNK_SIZE + 1))
    with f.open("rb") as handle:
        content = calls.upload_content(handle)
        assert not isinstance(content, bytes)
        assert [len(c) for c in content] == [calls.CHUNK_SIZE, 1]
    chunks = [b"a", b"b"]
    assert calls.upload_content(chunks) is chunks


# Credentials


@pytest.fixture
def config_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.delenv("SPACE_API_URL", raising=False)
    monkeypatch.delenv("SPACE_API_KEY", raising=False)
    return tmp_path


def _save(config_home: Path, content: str) -> None:
    (config_home / "space").mkdir(exist_ok=True)
    (config_home / "space" / "credentials.json").write_text(content)


def test_credentials_file_location(config_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert credentials_path() == config_home / "space" / "credentials.json"
    monkeypatch.delenv("XDG_CONFIG_HOME")
    assert credentials_path() == Path.home() / ".config" / "space" / "credentials.json"


def test_arguments_then_environment_then_file(
    config_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save(config_home, json.dumps({"api_url": "http://file:1", "api_key": "sk_file"}))
    assert resolve_credentials() == Credentials("http://file:1", "sk_file")
    monkeypatch.setenv("SPACE_API_KEY", "sk_env")
    assert resolve_credentials() == Credentials("http://file:1", "sk_env")
    monkeypatch.setenv("SPACE_API_URL", "http://env:2")
    assert resolve_credentials() == Credentials("http://env:2", "sk_env")
    assert resolve_credentials("http://arg:3", "sk_arg") == Credentials("http://arg:3", "sk_arg")


def test_saved_credentials_are_found_and_private(config_home: Path) -> None:
    path = save_credentials(Credentials("http://saved:4", "sk_saved"))
    assert path == credentials_path()
    assert path.stat().st_mode & 0o777 == 0o600
    assert resolve_credentials() == Credentials("http://saved:4", "sk_saved")
    assert [p.name for p in path.parent.iterdir()] == ["credentials.json"]


def test_the_url_has_a_default_and_the_key_does_not(config_home: Path) -> None:
    with pytest.raises(SpaceError) as info:
        resolve_credentials()
    message = str(info.value)
    assert "SPACE_API_KEY" in message and "space up" in message
    assert str(config_home / "space" / "credentials.json") in message
    assert resolve_credentials(api_key="sk_x").api_url == DEFAULT_API_URL


def test_a_broken_file_is_reported_unless_not_needed(config_home: Path) -> None:
    _save(config_home, "{not json")
    with pytest.raises(SpaceError, match="cannot read the credentials file"):
        resolve_credentials()
    assert resolve_credentials("http://a:1", "sk_a") == Credentials("http://a:1", "sk_a")
    _save(config_home, "[1, 2]")
    with pytest.raises(SpaceError, match="not a JSON object"):
        resolve_credentials()


# The package and the CLI


def test_import_space_does_not_load_the_sdk() -> None:
    code = (
        "import sys, space; assert 'httpx' not in sys.modules, 'httpx imported';"
        "from space import Sandbox, AsyncSandbox, NotFoundError; assert 'httpx' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_public_name_resolves() -> None:
    for name in space.__all__:
        assert getattr(space, name) is not None
    assert issubclass(space.NotFoundError, space.APIError)
    with pytest.raises(AttributeError):
        _ = space.Nope


def _run(*args: str) -> Any:
    env = {"SPACE_API_KEY": "sk_test", "SPACE_API_URL": "http://127.0.0.1:9"}
    return CliRunner().invoke(cli, list(args), env=env)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["sandbox", "create", "--env", "NOVALUE"], "'NOVALUE' is not KEY=VALUE"),
        (["sandbox", "create", "--metadata", "=x"], "'=x' is not KEY=VALUE"),
        (["sandbox", "create", "--timeout-action", "explode"], "'explode' is not one of"),
        (["sandbox", "create", "--vcpus", "0"], "0 is not in the range x>=1"),
        (["sandbox", "ls", "--metadata", "team"], "'team' is not KEY=VALUE"),
        (["exec", "sb-x"], "Missing argument 'COMMAND...'"),
        (["exec", "--timeout", "0", "sb-x", "--", "ls"], "0.0 is not in the range x>0"),
        (["cp", "a.txt", "b.txt"], "exactly one of SRC and DST must be a sandbox path"),
        (["cp", "sb-a:/x", "sb-b:/y"], "exactly one of SRC and DST must be a sandbox path"),
        (["cp", "sb-a:relative", "b"], "exactly one of SRC and DST must be a sandbox path"),
    ],
)
def test_cli_rejects_bad_arguments_clearly(args: list[str], message: str) -> None:
    result = _run(*args)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_cli_turns_an_unreachable_api_into_one_line() -> None:
    result = _run("sandbox", "get", "sb-x")
    assert result.exit_code == 1
    assert result.output.startswith("Error: cannot talk to the SPACE API at http://127.0.0.1:9")
    assert "Traceback" not in result.output
