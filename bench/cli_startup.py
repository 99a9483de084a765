"""CLI start-up benchmark: how long `space` takes to answer, from exec to exit.

Each command runs as a person or an agent runs it (the installed `space` entry point, a new
process each time, output to a pipe), interleaved with the baselines of the same run:
`python -c pass` (the interpreter alone) and `python -c "import httpx"` (the HTTP client alone).
`space sandbox ls` lists 20 sandboxes from a loopback stand-in of the API (tests/cli/stub_api.py),
so no platform is needed. The target is <= 150 ms over `python -c pass` at p50.

  .venv/bin/python bench/cli_startup.py [--runs 30] [--json out.json]
                                        [--compare-src DIR [--compare-label NAME]]

--compare-src runs the same commands again with another source tree first on PYTHONPATH
(e.g. an older commit's src/), as a before/after in the same run, labelled NAME.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.cli.stub_api

from tests.cli.stub_api import StubAPI, sandbox

from vm_runtime import percentiles

TARGET_MS = 150.0
SPACE = str(Path(sys.executable).parent / "space")
BASELINES = {
    "python -c pass": [sys.executable, "-c", "pass"],
    'python -c "import httpx"': [sys.executable, "-c", "import httpx"],
}
COMMANDS = {
    "space --version": [SPACE, "--version"],
    "space --help": [SPACE, "--help"],
    "space sandbox ls --help": [SPACE, "sandbox", "ls", "--help"],
    "space exec --help": [SPACE, "exec", "--help"],
    "space sandbox ls (20 sandboxes, loopback API)": [SPACE, "sandbox", "ls"],
}


def timed(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, env=env, capture_output=True, check=True)
    return time.perf_counter() - started


def measure(runs: int, compare_src: Path | None, label: str) -> dict[str, Any]:
    with StubAPI([sandbox(n) for n in range(20)]) as api:
        env = {**os.environ, **api.env()}
        cases = {name: (argv, env) for name, argv in {**BASELINES, **COMMANDS}.items()}
        if compare_src is not None:
            before = {**env, "PYTHONPATH": str(compare_src)}
            cases |= {f"{name} [{label}]": (argv, before) for name, argv in COMMANDS.items()}
        for argv, case_env in cases.values():  # warm the page cache and .pyc files
            timed(argv, case_env)
        samples: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(runs):  # interleaved, so that a busy moment hits every case alike
            for name, (argv, case_env) in cases.items():
                samples[name].append(timed(argv, case_env))
        assert len(api.requests) == (runs + 1) * (2 if compare_src else 1)  # every ls asked
    results: dict[str, Any] = {name: percentiles(s) for name, s in samples.items()}
    base = results["python -c pass"]["p50_ms"]
    for name in cases:
        results[name]["over_python_p50_ms"] = results[name]["p50_ms"] - base
    return results


def table(results: dict[str, Any]) -> str:
    rows = [("command", "p50 ms", "p90 ms", "p50 over python -c pass")]
    for name, r in results.items():
        if isinstance(r, dict) and "p50_ms" in r:
            rows.append((name, f"{r['p50_ms']:.1f}", f"{r['p90_ms']:.1f}",
                         f"{r['over_python_p50_ms']:+.1f}"))  # fmt: skip
    width = max(len(r[0]) for r in rows) + 2
    lines = ["  ".join([r[0].ljust(width), *(c.rjust(10) for c in r[1:])]) for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--compare-src", type=Path, help="another src/ to measure the same way")
    parser.add_argument("--compare-label", default="before", help="its name in the results")
    args = parser.parse_args()
    if args.runs < 20:
        parser.error("--runs must be at least 20")
    results = measure(args.runs, args.compare_src, args.compare_label)
    slow = [name for name in COMMANDS if results[name]["over_python_p50_ms"] > TARGET_MS]
    results["meta"] = {
        "runs": args.runs,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "target_over_python_ms": TARGET_MS,
        "compared_with": args.compare_label if args.compare_src else None,
        "over_target": slow,
    }
    document = json.dumps(results, indent=2)
    if args.json:
        args.json.write_text(document + "\n")
    print(table(results))
    print(f"target: <= {TARGET_MS:.0f} ms over python -c pass (p50); over it: {slow or 'none'}")
    print(document)


if __name__ == "__main__":
    main()
