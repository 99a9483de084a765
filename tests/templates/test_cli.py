"""`space template build/ls/rm`, run as a user would (no build VM: the spec has no disk steps)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from space.worker.storage.pool import ensure_pool
from space.worker.templates import latest_templates

SPACE = str(Path(sys.executable).parent / "space")


def space(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SPACE, *args], input="", capture_output=True, text=True, timeout=300, check=False
    )


@pytest.fixture
def out_root() -> Iterator[Path]:
    root = ensure_pool().root / "test-templates" / f"cli-{uuid.uuid4().hex[:8]}"
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_build_list_remove(tmp_path: Path, out_root: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "usr/bin").mkdir(parents=True)
    (tree / "usr/bin/python3").write_text("#!/bin/false\n")  # passes the static check only
    (tree / "usr/bin/python3").chmod(0o755)
    (tmp_path / "space.toml").write_text(
        '[template]\nname = "clidemo"\nfrom = "dir:tree"\nstart = "serve"\n'
        '[[steps]]\nenv = { MODE = "cli" }\n[[steps]]\nuser = "nobody"\n'
    )
    r = space(
        "template", "build", "--local", "-f", str(tmp_path / "space.toml"), "--out", str(out_root)
    )
    assert r.returncode == 0, r.stderr + r.stdout
    assert "built clidemo" in r.stdout
    [built] = list((out_root / "templates/clidemo").iterdir())
    record = json.loads((built / "template.json").read_text())
    assert record["env"]["MODE"] == "cli" and record["user"] == "nobody"
    assert record["start"] == "serve" and (built / "rootfs.ext4").is_file()

    assert latest_templates(out_root)["clidemo"].digest == built.name
    r = space("template", "ls", "--root", str(out_root))
    assert r.returncode == 0 and "clidemo" in r.stdout, r.stderr
    r = space("template", "rm", "clidemo", "--root", str(out_root))
    assert r.returncode == 0 and f"removed clidemo {built.name}" in r.stdout, r.stderr
    assert not (out_root / "templates/clidemo").exists()


def test_bad_spec_is_one_clear_line(tmp_path: Path) -> None:
    (tmp_path / "space.toml").write_text('[template]\nname = "x"\nfrom = "debian:sid"\n')
    r = space("template", "build", "-f", str(tmp_path))
    assert r.returncode == 1
    assert "only debian:bookworm" in r.stderr and "Traceback" not in r.stderr
