"""Runs the real `space` command in a child process, as a person or a script would."""

from __future__ import annotations

import os
import re
import subprocess
import sys

IMPORT_LINE = re.compile(r"^import time:\s+\d+ \|\s+\d+ \|\s+(\S+)$", re.M)


def space(
    *args: str,
    env: dict[str, str] | None = None,
    status: int = 0,
    importtime: bool = False,
    stdin: str = "",
) -> subprocess.CompletedProcess[str]:
    """A run of `space ARGS` that must end with `status`; with `importtime`, its stderr also
    lists every module it imported (see `modules`)."""
    flags = ["-X", "importtime"] if importtime else []
    run = subprocess.run(
        [sys.executable, *flags, "-m", "space.cli.main", *args],
        capture_output=True,
        text=True,
        input=stdin,
        env={**os.environ, **(env or {})},
        timeout=120,
    )
    assert run.returncode == status, (run.returncode, run.stdout[-2000:], run.stderr[-2000:])
    return run


def modules(run: subprocess.CompletedProcess[str]) -> set[str]:
    names = set(IMPORT_LINE.findall(run.stderr))
    assert "space.cli.lazy" in names, "not a run with importtime"
    return names
