"""Every listing prints a table for people and, with --json, a document whose keys are the ones
docs/cli.md promises. API listings run against a loopback stand-in of the API; `template ls` and
`vm ls` read this host (the latter with a real VM)."""

from __future__ import annotations

import json
import uuid
from datetime import datetime
from pathlib import Path

import pytest

from space.worker.templates.record import RECORD_FILE, TemplateRecord
from tests.cli.runner import space
from tests.cli.stub_api import KEY, StubAPI, sandbox, template, volume

# docs/cli.md, "JSON output"
SANDBOX_KEYS = {
    "id", "state", "desired_state", "reason", "template", "vcpus", "memory_mib", "disk_mib",
    "timeout_s", "timeout_action", "expires_at", "env", "metadata", "worker_id", "created_at",
    "updated_at", "boot", "volumes", "idle_timeout_s",
}  # fmt: skip
POOL_KEYS = {"template", "size", "vcpus", "memory_mib", "disk_mib", "ready", "starting"}
VOLUME_KEYS = {"id", "name", "size_mib", "state", "created_at"}
TEMPLATE_KEYS = {
    "name", "digest", "path", "source", "source_digest", "rootfs", "size_bytes", "env", "workdir",
    "user", "entrypoint", "cmd", "start", "ready", "steps", "built_at", "build_seconds",
    "snapshot", "vcpus", "memory_mib",
}  # fmt: skip
VM_KEYS = {"id", "alive", "pid", "vcpus", "memory_mib", "hostname"}


def same_instant(a: str, b: str) -> bool:
    return datetime.fromisoformat(a) == datetime.fromisoformat(b)


def test_sandbox_ls_json_has_every_page_and_the_documented_keys() -> None:
    rows = [sandbox(n, metadata={"team": "a", "n": str(n)}) for n in range(5)]
    with StubAPI(rows, page_size=2) as api:
        listed = json.loads(space("sandbox", "ls", "--json", env=api.env()).stdout)
        assert len(api.requests) == 3  # pages of 2, 2 and 1
    assert [item["id"] for item in listed] == [r["id"] for r in rows]
    for item, row in zip(listed, rows, strict=True):
        assert set(item) == SANDBOX_KEYS
        assert item["metadata"] == row["metadata"]
        assert same_instant(item["created_at"], row["created_at"])
        assert same_instant(item["expires_at"], row["expires_at"])


def test_sandbox_get_prints_the_same_object_as_ls() -> None:
    with StubAPI([sandbox(7)]) as api:
        got = json.loads(space("sandbox", "get", sandbox(7)["id"], env=api.env()).stdout)
        listed = json.loads(space("sandbox", "ls", "--json", env=api.env()).stdout)
    assert got == listed[0]


def test_sandbox_ls_filters_reach_the_api() -> None:
    with StubAPI([sandbox(1)]) as api:
        space("sandbox", "ls", "--json", "--state", "paused", "-m", "team=a b", env=api.env())
    assert api.requests == ["/v1/sandboxes?limit=100&state=paused&metadata.team=a+b"]


def test_sandbox_ls_table_keeps_one_line_per_sandbox_and_prints_text_as_it_is() -> None:
    rows = [sandbox(1), sandbox(2, state="paused", desired_state="paused",
                                metadata={"note": "[bold]x[/bold] y"})]  # fmt: skip
    with StubAPI(rows) as api:
        out = space("sandbox", "ls", env=api.env()).stdout.splitlines()
    assert out[0].split() == ["ID", "STATE", "TEMPLATE", "VCPUS", "MEMORY", "CREATED",
                              "EXPIRES", "METADATA"]  # fmt: skip
    assert len(out) == 3
    assert out[1].split()[:3] == [rows[0]["id"], "running", "base"]
    assert out[2].split()[:2] == [rows[1]["id"], "paused"]
    assert out[2].endswith("note=[bold]x[/bold] y")  # no markup, no ANSI styles when piped
    # Columns line up: every row's STATE starts where the header's does.
    column = out[0].index("STATE")
    assert {line[column - 2 : column] for line in out} == {"  "}
    assert all(line[column] != " " for line in out)


def test_empty_listings_say_so_on_stderr_and_json_is_an_empty_list() -> None:
    with StubAPI() as api:
        table = space("sandbox", "ls", env=api.env())
        assert (table.stdout, table.stderr.strip()) == ("", "no sandboxes")
        for command in (("sandbox", "ls"), ("pool", "ls"), ("volume", "ls")):
            assert json.loads(space(*command, "--json", env=api.env()).stdout) == []


def test_pool_ls_json() -> None:
    with StubAPI(templates=[template("base", size=2, ready=1), template("web", 0, 0)]) as api:
        listed = json.loads(space("pool", "ls", "--json", env=api.env()).stdout)
        table = space("pool", "ls", env=api.env()).stdout.splitlines()
    assert [set(p) for p in listed] == [POOL_KEYS, POOL_KEYS]
    assert listed[0] == {"template": "base", "size": 2, "vcpus": 1, "memory_mib": 256,
                         "disk_mib": 1024, "ready": 1, "starting": 1}  # fmt: skip
    assert table[0].split() == ["TEMPLATE", "SIZE", "READY", "STARTING", "SHAPE"]
    assert table[1].split()[:4] == ["base", "2", "1", "1"]


def test_volume_ls_json() -> None:
    with StubAPI(volumes=[volume(1, "data"), volume(2)]) as api:
        listed = json.loads(space("volume", "ls", "--json", env=api.env()).stdout)
    assert [v["id"] for v in listed] == [volume(1)["id"], volume(2)["id"]]
    assert all(set(v) == VOLUME_KEYS for v in listed)
    assert listed[0]["name"] == "data" and listed[0]["size_mib"] == 1024


def test_a_refused_key_is_one_line_and_no_half_document() -> None:
    with StubAPI([sandbox(1)]) as api:
        env = {**api.env(), "SPACE_API_KEY": KEY + "x"}
        run = space("sandbox", "ls", "--json", env=env, status=1)
    assert run.stdout == ""
    assert run.stderr.startswith("Error: 401 Unauthorized: bad key")
    assert "Traceback" not in run.stderr


def test_an_unreachable_api_is_one_line() -> None:
    env = {"SPACE_API_URL": "http://127.0.0.1:9", "SPACE_API_KEY": KEY}
    run = space("volume", "ls", "--json", env=env, status=1)
    assert run.stdout == ""
    assert run.stderr.startswith("Error: cannot talk to the SPACE API at http://127.0.0.1:9")


def test_template_ls_json_lists_the_records_built_under_a_root(tmp_path: Path) -> None:
    record = TemplateRecord(
        name="web", digest="d" * 16, path=tmp_path / "templates" / "web" / ("d" * 16),
        source="docker.io/library/nginx:1", source_digest="sha256:" + "0" * 64,
        size_bytes=3 << 20, env={"PATH": "/bin"}, cmd=["nginx"], steps=["run: true"],
        built_at="2026-12-01T10:00:00Z",
    )  # fmt: skip
    record.path.mkdir(parents=True)
    (record.path / RECORD_FILE).write_text(json.dumps(record.to_json()))
    listed = json.loads(space("template", "ls", "--root", str(tmp_path), "--json").stdout)
    assert len(listed) == 1 and set(listed[0]) == TEMPLATE_KEYS
    assert listed[0]["path"] == str(record.path)
    assert listed[0]["cmd"] == ["nginx"] and listed[0]["size_bytes"] == 3 << 20
    table = space("template", "ls", "--root", str(tmp_path)).stdout
    assert "web" in table and "d" * 16 in table


@pytest.mark.vm
def test_vm_ls_json_shows_a_real_vm() -> None:
    vm_id = f"cli-{uuid.uuid4().hex[:8]}"
    space("vm", "boot", "--id", vm_id, "--hostname", "listed")
    try:
        listed = json.loads(space("vm", "ls", "--json").stdout)
        ours = [v for v in listed if v["id"] == vm_id]
        assert len(ours) == 1 and set(ours[0]) == VM_KEYS
        assert ours[0]["alive"] is True and ours[0]["hostname"] == "listed"
        assert ours[0]["vcpus"] == 1 and ours[0]["memory_mib"] == 256
    finally:
        space("vm", "rm", vm_id)
    assert vm_id not in {v["id"] for v in json.loads(space("vm", "ls", "--json").stdout)}
