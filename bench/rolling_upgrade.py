"""Rolling-upgrade benchmark: what a client sees while the platform is upgraded from the
previous release (CHANGELOG.md) to this checkout and rolled back, one service at a time.

A platform of the previous release with a warm pool, and a client that loops create → `echo ok`
→ delete (tests/upgrade/rollout.py). Its rounds before the rollout are the baseline of the same
run; then the schema, the API, the controller and the worker are replaced by this release's,
and back. Per step: rounds, errors, create p50/p99 and the slowest round. Run as root:
  .venv/bin/python bench/rolling_upgrade.py [--rounds 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.upgrade

from tests.stack import launch, shut_down
from tests.upgrade.rollout import Traffic, check_out, migrate, previous_release, replace, summary

from report import emit
from space.release import VERSION


def bench(rounds: int) -> dict[str, Any]:
    version, commit = previous_release()
    with tempfile.TemporaryDirectory(prefix="space-upgrade-") as tmp:
        code = check_out(commit, Path(tmp))
        (Path(tmp) / "platform").mkdir()
        p = launch(Path(tmp) / "platform", release=code, SPACE_WORKER_LOST_AFTER="8")
        try:
            with p.client(p.admin_key) as admin:
                admin.put("/v1/templates/base/pool", json={"size": 2}).raise_for_status()
            (worker,) = p.workers.values()
            with Traffic(p.api_url, p.key_a) as traffic:
                traffic.wait_rounds("before", rounds)
                migrate(p, traffic, rounds // 2)
                for step, svc in (("api", p.api), ("controller", p.controller),
                                  ("worker", worker)):  # fmt: skip
                    replace(p, traffic, step, svc, None, rounds // 2)
                traffic.step = "upgraded"
                traffic.wait_rounds("upgraded", rounds)
                for step, svc in (("worker back", worker), ("controller back", p.controller),
                                  ("api back", p.api)):  # fmt: skip
                    replace(p, traffic, step, svc, code, rounds // 2)
                traffic.step = "rolled back"
                traffic.wait_rounds("rolled back", rounds)
        finally:
            shut_down(p)
    return {"from": version, "to": VERSION, "steps": summary(traffic.rounds),
            "errors": traffic.errors()}  # fmt: skip


def table(results: dict[str, Any]) -> str:
    lines = [f"{results['from']} → {results['to']} and back",
             f"{'step':16} {'rounds':>6} {'errors':>6} {'create p50':>10} {'create p99':>10} "
             f"{'slowest round':>13}"]  # fmt: skip
    for step, s in results["steps"].items():
        lines.append(f"{step:16} {s['rounds']:6} {s['errors']:6} {s['create_p50_s']:9}s "
                     f"{s['create_p99_s']:9}s {s['slowest_round_s']:12}s")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20, help="rounds before, upgraded and after")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = bench(args.rounds)
    print(table(results), file=sys.stderr)
    emit(results, args.json)


if __name__ == "__main__":
    main()
