"""E2B's JavaScript SDKs, unmodified (`e2b` and `@e2b/code-interpreter`, pinned by
tests/e2b_js/package-lock.json), against SPACE under Node.js: commands, files, watch, PTY,
lifecycle and the code interpreter, configured only by E2B's own environment variables."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ..stack import Platform

pytestmark = pytest.mark.vm

HERE = Path(__file__).parent.parent / "e2b_js"
NODE_MIN = (20, 18)  # what the SDKs' `engines` ask for


def _node() -> str | None:
    node = shutil.which("node")
    if node is None:
        return None
    version = subprocess.run([node, "--version"], capture_output=True, text=True).stdout
    major, minor = (int(n) for n in version.strip().lstrip("v").split(".")[:2])
    return node if (major, minor) >= NODE_MIN else None


def test_the_javascript_sdks(platform: Platform, code_interpreter: str) -> None:
    node = _node()
    if node is None:
        pytest.skip("no Node.js >= 20.18 on this host (the SDKs' engines); `make test-deps` "
                    "installs the SDKs where there is one")  # fmt: skip
    assert (HERE / "node_modules" / "e2b").is_dir(), "run `make test-deps` (npm ci there)"
    env = {**os.environ, "E2B_API_KEY": platform.key_a, "E2B_API_URL": f"{platform.api_url}/e2b",
           "E2B_SANDBOX_URL": f"{platform.api_url}/e2b/envd"}  # fmt: skip
    done = subprocess.run([node, "conformance.mjs"], cwd=HERE, env=env, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    checks = json.loads(done.stdout.strip().splitlines()[-1])
    failed = {name: c["seen"] for name, c in checks.items() if not c["ok"]}
    assert not failed, failed
    # Every check the script makes was made: no part of it stopped early.
    named = set(re.findall(r"check\(\s*'([^']+)'", (HERE / "conformance.mjs").read_text()))
    assert set(checks) == {n for n in named if not n.endswith("threw")}, sorted(checks)
