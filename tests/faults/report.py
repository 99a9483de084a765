"""The fault suite's figures as the README's markdown table.

SPACE_FAULT_REPORT=/tmp/faults.json .venv/bin/pytest tests/faults
.venv/bin/python -m tests.faults.report /tmp/faults.json
"""

from __future__ import annotations

import json
import sys


def table(rows: list[dict[str, object]]) -> str:
    lines = ["| fault injected | promise | bound (s) | measured (s) |", "|---|---|--:|--:|"]
    for r in rows:
        bound, measured = f"{r['bound_s']:g}", f"{r['measured_s']:.2f}"
        lines.append(f"| {r['fault']} | {r['promise']} | {bound} | {measured} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        print(table(json.load(f)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
