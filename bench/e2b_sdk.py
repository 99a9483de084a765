"""E2B's SDK against SPACE, beside SPACE's own SDK in the same run:

  - create → first command answered: `e2b.Sandbox.create()` + `commands.run("true")`  vs
    `space.Sandbox.create()` + `exec(["true"])` (no warm pool, one at a time, alternated)
  - a command's round trip on a running sandbox: `commands.run("true")` (envd's Connect RPC,
    answered by the API)  vs  `exec(LOGIN)`, SPACE's NDJSON exec of what E2B's SDK runs (its
    commands run in a login shell, `/bin/bash -l -c`, which costs the guest ~35 ms under TCG),
    and `exec(["true"])` beside them
  - the code interpreter (`e2b_code_interpreter`): create → first cell answered
    (`Sandbox.create()` + `run_code("1 + 1")`) and a cell's round trip, beside the E2B SDK's
    create → first command and command round trip above

The difference from SPACE's exec of the same command is what the E2B surface costs: its token
check, the Connect encoding and the process started in the background (envd's semantics).

Starts its own embedded PostgreSQL, API, controller and worker. Run as root:
  .venv/bin/python bench/e2b_sdk.py [--creates 20] [--execs 100] [--cells 100] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import secrets
import time
from pathlib import Path
from typing import Any

import e2b
import e2b_code_interpreter

import space
import space.interpreter
from services import platform
from space.db.store import Store
from vm_runtime import percentile_table, percentiles

LOGIN = ["/bin/bash", "-l", "-c", "true"]  # what E2B's `commands.run("true")` starts


async def setup(store: Store) -> dict[str, str]:
    tenant = await store.create_tenant(f"bench-e2b-{secrets.token_hex(3)}")
    admin = await store.create_tenant(f"bench-e2b-admin-{secrets.token_hex(3)}")
    return {"key": await store.create_api_key(tenant.id),
            "admin": await store.create_api_key(admin.id, admin=True)}  # fmt: skip


def timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--creates", type=int, default=20)
    parser.add_argument("--execs", type=int, default=100)
    parser.add_argument("--cells", type=int, default=100)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with platform(setup) as (p, keys):
        e2b_opts: dict[str, Any] = {"api_key": keys["key"], "api_url": f"{p.url}/e2b",
                                    "sandbox_url": f"{p.url}/e2b/envd"}  # fmt: skip
        sdk = space.Space(p.url, keys["key"])
        p.wait_worker(keys["key"])
        # The first create builds the worker's base snapshot (a cold boot): not measured.
        space.Sandbox.create(client=sdk).delete()

        def e2b_create() -> None:
            sbx = e2b.Sandbox.create(**e2b_opts)
            sbx.commands.run("true")
            created.append(sbx)

        def space_create(argv: list[str]) -> None:
            sbx = space.Sandbox.create(client=sdk)
            sbx.exec(argv)
            made.append(sbx)

        created: list[e2b.Sandbox] = []
        made: list[space.Sandbox] = []
        e2b_creates: list[float] = []
        space_creates: dict[str, list[float]] = {"login": [], "true": []}
        for _ in range(args.creates):  # alternated, so drift hits both alike
            e2b_creates.append(timed(e2b_create))
            created.pop().kill()
            for name, argv in (("login", LOGIN), ("true", ["true"])):
                space_creates[name].append(timed(lambda a=argv: space_create(a)))
                made.pop().delete()

        sbx = e2b.Sandbox.create(**e2b_opts)
        own = space.Sandbox.get(sbx.sandbox_id, client=sdk)
        e2b_execs: list[float] = []
        space_execs: dict[str, list[float]] = {"login": [], "true": []}
        for _ in range(args.execs):
            e2b_execs.append(timed(lambda: sbx.commands.run("true")))
            space_execs["login"].append(timed(lambda: own.exec(LOGIN)))
            space_execs["true"].append(timed(lambda: own.exec(["true"])))
        sbx.kill()
        ci_creates, cells = interpreter(p.url, keys, e2b_opts, args.creates, args.cells)
        sdk.close()
    results: dict[str, Any] = {
        "e2b_sdk_create_to_first_command": percentiles(e2b_creates),
        "space_sdk_create_to_first_login_shell": percentiles(space_creates["login"]),
        "space_sdk_create_to_first_command": percentiles(space_creates["true"]),
        "e2b_sdk_command_true": percentiles(e2b_execs),
        "space_sdk_exec_login_shell": percentiles(space_execs["login"]),
        "space_sdk_exec_true": percentiles(space_execs["true"]),
        "e2b_code_interpreter_create_to_first_cell": percentiles(ci_creates),
        "e2b_code_interpreter_cell_1_plus_1": percentiles(cells),
    }

    def ratio(a: str, b: str) -> float:
        return float(results[a]["p50_ms"]) / float(results[b]["p50_ms"])

    results["ratio_create_p50"] = ratio(
        "e2b_sdk_create_to_first_command", "space_sdk_create_to_first_login_shell"
    )
    results["ratio_command_p50"] = ratio("e2b_sdk_command_true", "space_sdk_exec_login_shell")
    results["ratio_cell_p50"] = ratio("e2b_code_interpreter_cell_1_plus_1", "e2b_sdk_command_true")
    print("\n".join(percentile_table(results)))
    print(f"E2B SDK / SPACE SDK running the same command, at p50: create → first command "
          f"{results['ratio_create_p50']:.2f}x, command {results['ratio_command_p50']:.2f}x; "
          f"a cell / an E2B command: {results['ratio_cell_p50']:.2f}x")  # fmt: skip
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


def interpreter(
    url: str, keys: dict[str, str], opts: dict[str, Any], creates: int, cells: int
) -> tuple[list[float], list[float]]:
    """The code-interpreter template built as `space up` builds it, then its creates (each to
    its first cell) and cells on one sandbox."""
    with space.Space(url, keys["admin"]) as admin:
        admin.build_template("code-interpreter", space.interpreter.SPEC)
        log = list(admin.build_log("code-interpreter"))
        built = {t.id: t for t in admin.templates()}.get("code-interpreter")
        if built is None or built.state != "ready":
            why = "\n".join(log[-20:]) + f"\n{built.error if built else 'no template'}"
            raise SystemExit(f"the code-interpreter template did not build:\n{why}")
    # The first create makes the template's base snapshot (a boot, the kernel started).
    e2b_code_interpreter.Sandbox.create(**opts).kill()
    made: list[float] = []
    for _ in range(creates):
        t = time.perf_counter()
        sbx = e2b_code_interpreter.Sandbox.create(**opts)
        sbx.run_code("1 + 1")
        made.append(time.perf_counter() - t)
        sbx.kill()
    sbx = e2b_code_interpreter.Sandbox.create(**opts)
    rounds = [timed(lambda: sbx.run_code("1 + 1")) for _ in range(cells)]
    sbx.kill()
    return made, rounds


if __name__ == "__main__":
    main()
