"""The red-team suite from inside a real microVM (QEMU/TCG) on a sandbox network: the tap, the
guest kernel's virtio-net and the agent's own eth0 set-up, instead of a namespace standing in."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

import pytest

from space.worker.agent_client import AgentClient
from space.worker.local import LocalRuntime, local_runtime
from space.worker.machine import DISK, new_token, new_vm_id
from space.worker.network import SandboxNetwork
from space.worker.network import netns as nsutil
from space.worker.storage.reflink import clone_file
from space.worker.vmm.base import VMConfig
from tests.network.test_gateway import ATTACKS, PLACEHOLDER, policy_a, policy_b
from tests.network.world import BEARER, HEADER_SECRET, Guest, World, guest_config

pytestmark = pytest.mark.vm


ECHO = """
import os, socket, ssl
ctx = ssl.create_default_context(cafile="/root/gateway-ca.pem")
s = ctx.wrap_socket(socket.create_connection(("secret.test", 443)), server_hostname="secret.test")
s.sendall(("GET /echo HTTP/1.1\\r\\nHost: secret.test\\r\\nAuthorization: Bearer "
           + os.environ["SPACE_SECRET_BEARER"] + "\\r\\n\\r\\n").encode())
out = b""
while d := s.recv(65536):
    out += d
open("/root/echo.txt", "wb").write(out)
print(out.decode())
"""


async def _run_in_vm(
    runtime: LocalRuntime, net: SandboxNetwork, files: dict[str, bytes], marker: str, dump: Path
) -> tuple[list[dict[str, Any]], str]:
    """Boot a VM on the sandbox's tap, run the suite in it, return its results and output.
    Then have an origin echo the credentials back, put `marker` in guest memory, and save the
    VM's memory and disk to `dump` (for the host to search for the secrets).

    Runs on a thread inside the sandbox's namespace, so QEMU (spawned from it) opens the tap
    there with `ifname=`; the worker will hand QEMU an fd instead (see docs/network.md)."""
    vm_id = new_vm_id()
    run_dir = runtime.pool.vms / vm_id
    run_dir.mkdir(parents=True)
    try:
        clone_file(runtime.images.rootfs, run_dir / DISK)
        token = new_token()
        config = VMConfig(
            vm_id=vm_id, kernel=runtime.images.kernel, initrd=runtime.images.initrd,
            rootfs=run_dir / DISK, memory_mib=512, hostname="redteam", agent_token=token,
            tap_device=net.tap, guest_mac=net.guest_mac,
        )  # fmt: skip
        vm = await runtime.driver.boot(config, run_dir)
        try:
            agent = await AgentClient.connect(vm.open_agent_stream, token, 180)
            try:
                for path, data in files.items():
                    await agent.write_file(path, data)
                result = await agent.run(
                    ["python3", "/root/attacks.py", "--json", "/root/out.json"],
                    env={"SPACE_REDTEAM_CONFIG": "/root/config.json",
                         "SPACE_SECRET_BEARER": PLACEHOLDER},
                    timeout=900,
                )  # fmt: skip
                output = (result.stdout + result.stderr).decode(errors="replace")
                try:
                    raw = await agent.read_file("/root/out.json")
                except Exception:
                    return [], output
                await agent.write_file("/root/echo.py", ECHO.encode())
                echo = await agent.run(
                    ["python3", "/root/echo.py"],
                    env={"SPACE_SECRET_BEARER": PLACEHOLDER}, timeout=120,
                )  # fmt: skip
                output += echo.stdout.decode(errors="replace")
                # The control: a string known to be in guest memory (tmpfs) and on its disk.
                await agent.run(["sh", "-c", f"echo {marker} > /dev/shm/m; echo {marker} > /m"])
                await vm.snapshot(dump)
                return json.loads(raw), output
            finally:
                await agent.close()
        finally:
            await vm.close()
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


async def test_redteam_suite_from_inside_a_real_vm(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("needs root (namespaces, QEMU)")
    runtime = await local_runtime()
    world = World(tmp_path / "world")
    try:
        await world.start()
        other = await world.add_guest("b", policy_b())
        net = await world.manager.create("vm")
        async with world.client() as gw:
            await gw.set_policy("vm", net.sandbox_ip, policy_a())
        assert world.origin_ca is not None
        config = guest_config(world, Guest("vm", "", net), [other], PLACEHOLDER)
        config.update(origin_ca="/root/origin-ca.pem", gateway_ca="/root/gateway-ca.pem")
        files = {
            "/root/attacks.py": ATTACKS.read_bytes(),
            "/root/config.json": json.dumps(config).encode(),
            "/root/origin-ca.pem": world.origin_ca.read_bytes(),
            "/root/gateway-ca.pem": world.gateway_ca.read_bytes(),
        }
        marker = "space-marker-" + secrets.token_hex(8)
        dump = runtime.pool.snapshots / f"redteam-{secrets.token_hex(4)}"
        try:
            results, output = await asyncio.to_thread(
                nsutil.run_in,
                net.netns,
                lambda: asyncio.run(_run_in_vm(runtime, net, files, marker, dump)),
            )
            (tmp_path / "vm-redteam.json").write_text(json.dumps(results, indent=1))
            found = _search(dump, [marker, BEARER, HEADER_SECRET, PLACEHOLDER])
        finally:
            shutil.rmtree(dump, ignore_errors=True)
    finally:
        await world.stop()
    assert results, output
    failed = [r for r in results if r["outcome"] not in ("held", "works")]
    assert not failed, "\n".join(f"{r['name']}: {r['outcome']} {r['detail']}" for r in failed)
    assert {r["name"] for r in results} >= {"allowed_https_passthrough_works", "ip_spoofing"}
    # Secrets never enter the guest: not in its memory (env, page cache, the echoed response)
    # nor on its disk, though it used them; the search does find what is there.
    assert "auth-ok" not in output and "Bearer ****" in output, output[-2000:]
    assert found[marker], "the search is blind: the control marker was not found"
    assert not found[BEARER] and not found[HEADER_SECRET]
    if report := os.environ.get("SPACE_SECURITY_REPORT"):
        Path(report).write_text(security_report(results, found))


def security_report(results: list[dict[str, Any]], found: dict[str, bool]) -> str:
    """SECURITY.md's results section, as this run found them (see SECURITY.md for the rest)."""
    rows = [
        f"| `{r['name']}` | {r['technique']} | {r['mitigation']} | **{r['outcome']}** |"
        for r in results
    ]
    held = not found[BEARER] and not found[HEADER_SECRET]
    memory_row = (
        "| `secret_in_guest_memory_and_disk` | search the VM's memory image and disk, after it "
        "used both secrets, for their values (a control string written by the guest is found) "
        f"| secrets never enter the guest | **{'held' if held else 'FAILED'}** |"
    )
    header = ["| attack | technique | expected mitigation | result |", "|---|---|---|---|"]
    return "\n".join([*header, *rows, memory_row, ""])


def _search(directory: Path, needles: list[str]) -> dict[str, bool]:
    """Which strings occur in any file under `directory` (read in overlapping chunks)."""
    found = dict.fromkeys(needles, False)
    patterns = [n.encode() for n in needles]
    overlap = max(map(len, patterns))
    for path in directory.rglob("*"):
        if not path.is_file():
            continue
        with path.open("rb") as f:
            tail = b""
            while chunk := f.read(16 << 20):
                data = tail + chunk
                for needle, pattern in zip(needles, patterns, strict=True):
                    found[needle] = found[needle] or pattern in data
                tail = data[-overlap:]
    return found
