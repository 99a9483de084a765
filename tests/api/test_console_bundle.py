"""The console's committed bundle (src/space/console/static/) is what its sources build to:
its manifest names every source file with its hash, and every built file with its hash; and,
where npm is at hand, building the sources afresh from the lock file gives the same bytes."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from space.console import STATIC

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ROOT / "console"
MANIFEST = json.loads((STATIC / "manifest.json").read_text())


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_bundle_was_built_from_the_sources_as_they_are() -> None:
    inputs = sorted(
        [p for p in (SOURCES / "src").rglob("*") if p.is_file()]
        + [SOURCES / name for name in ("package.json", "package-lock.json", "build.mjs")]
    )
    now = {p.relative_to(SOURCES).as_posix(): sha256(p) for p in inputs}
    assert now == MANIFEST["inputs"], "the console's sources changed: run `make console`"


def test_every_built_file_is_there_and_referenced() -> None:
    built = {p.name: sha256(p) for p in STATIC.iterdir() if p.name != "manifest.json"}
    assert built == MANIFEST["outputs"]
    page = (STATIC / "index.html").read_text()
    referenced = re.findall(r'(?:src|href)="assets/([^"]+)"', page)
    assert sorted(referenced) == sorted(n for n in built if n != "index.html")
    assert {Path(n).suffix for n in referenced} == {".js", ".css"}
    assert 'nonce="__NONCE__"' in page  # the API puts a fresh nonce there


def test_building_the_sources_again_gives_the_same_bundle(tmp_path: Path) -> None:
    if shutil.which("npm") is None:
        pytest.skip("npm is not installed: the manifest tests above still hold")
    work = tmp_path / "console"
    shutil.copytree(SOURCES, work, ignore=shutil.ignore_patterns("node_modules"))
    npm = ["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"]
    subprocess.run(npm, cwd=work, check=True, timeout=300)
    out = tmp_path / "static"
    subprocess.run(["node", "build.mjs", str(out)], cwd=work, check=True, timeout=120)
    again = {p.name: p.read_bytes() for p in out.iterdir()}
    assert again == {p.name: p.read_bytes() for p in STATIC.iterdir()}
