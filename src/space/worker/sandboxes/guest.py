"""The platform's own duties inside a guest: its CA, its volumes, a template's service.

The CA and the volumes are the agent's built-in calls, never a program of the guest's (the
tenant may have replaced any of them). Each duty has a deadline on the host side (a guest that
hangs or is stopped cannot hold the worker), and what the worker reads back is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shlex
import time
from collections.abc import Sequence
from typing import Any

from space.worker.agent_client import AgentError, ExecResult, GuestVolume
from space.worker.machine import Machine
from space.worker.sandboxes.errors import InvalidArgument, VMManagerError
from space.worker.sandboxes.records import VolumeMount
from space.worker.templates import TemplateRecord
from space.worker.templates.record import agent_user
from space.worker.vmm.base import VMMError, VMState

log = logging.getLogger(__name__)

START_LOG = "/var/log/space-start.log"  # in the guest: what the template's start command printed
CA_FILE = "/etc/space/ca.pem"  # in the guest: the gateway's CA
CA_BUNDLE = "/etc/space/ca-bundle.pem"  # the system's CAs and the gateway's
CA_ENV = {
    "SSL_CERT_FILE": CA_BUNDLE,
    "REQUESTS_CA_BUNDLE": CA_BUNDLE,
    "CURL_CA_BUNDLE": CA_BUNDLE,
    "GIT_SSL_CAINFO": CA_BUNDLE,  # git's libcurl reads none of the above
    "NODE_EXTRA_CA_CERTS": CA_FILE,
}
READY_TIMEOUT_S = 300.0
DUTY_TIMEOUT_S = 30.0
WARM_TIMEOUT_S = 5.0


async def run(machine: Machine, argv: list[str], timeout: float = DUTY_TIMEOUT_S,
              **how: Any) -> ExecResult:  # fmt: skip
    """A command of the platform's in the guest, bounded in time on the host side too."""
    try:
        return await asyncio.wait_for(machine.agent.run(argv, timeout=timeout, **how), timeout + 5)
    except TimeoutError:
        raise VMManagerError(
            f"VM {machine.id}: {argv[0]} did not finish in {timeout:.0f} s"
        ) from None


async def install_ca(machine: Machine, pem: bytes) -> None:
    """The gateway's CA in the guest's trust store (a bundle next to the system's), so the
    TLS it terminates verifies; CA_ENV points the usual variables at it. The agent's own call:
    no program of the guest's runs for it."""
    try:
        await machine.agent.install_ca(pem, deadline=DUTY_TIMEOUT_S)
    except AgentError as e:
        raise VMManagerError(f"installing the gateway CA failed: {e}") from None


async def mount_volumes(machine: Machine, volumes: Sequence[VolumeMount]) -> None:
    """Mount each volume where asked (read-only ones skip the journal: the device, read-only
    for the VMM too, refuses its replay)."""
    wanted = [GuestVolume(v.id, v.path, v.read_only) for v in volumes]
    try:
        await machine.agent.mount_volumes(wanted, deadline=DUTY_TIMEOUT_S)
    except AgentError as e:
        raise InvalidArgument(f"mounting volumes failed: {e}") from None


async def release_volumes(machine: Machine, volumes: Sequence[VolumeMount]) -> None:
    """Flush and unmount the volumes before the VM goes: best effort, the VM goes anyway."""
    try:
        if machine.status().state == VMState.PAUSED and machine.io_error is None:
            await machine.resume()
        result = await machine.agent.unmount([v.path for v in volumes], deadline=10)
        for target, why in result.failed.items():
            log.warning("VM %s: volume at %s not cleanly unmounted: %s", machine.id, target, why)
    except (VMMError, AgentError, TimeoutError, VMManagerError) as e:
        log.warning("VM %s: volumes not cleanly unmounted: %s", machine.id, e)


# What the first commands of a sandbox run: the platform's own exec paths, and the login shell
# E2B's SDKs wrap every command in (where the template has bash).
WARM_UP = (["true"], ["/bin/sh", "-c", "command -v bash >/dev/null && exec bash -l -c true; true"])


async def warm(machine: Machine, **how: Any) -> None:
    """Run what a sandbox's first commands run, once, as the template runs them (`how`: its
    user, environment and directory): in a base snapshot, their files are then in its page
    cache; in a restored VM, the first exec no longer pays for translating that path afresh
    (~130 ms under TCG), which a pool member should not hand to its claimer. Best effort: a
    template without a shell, or with a login profile that hangs, has less warmed."""
    for argv in WARM_UP:
        with contextlib.suppress(AgentError, VMManagerError):
            await run(machine, argv, timeout=WARM_TIMEOUT_S, **how)


def runs_as(record: TemplateRecord | None) -> dict[str, Any]:
    """How a template's commands run: its environment, directory and user (the run's options)."""
    if record is None:
        return {}
    return {"env": record.env, "cwd": record.workdir, "user": agent_user(record.user)}


async def start_service(machine: Machine, record: TemplateRecord) -> None:
    """Start the template's service (its start command, else the image's own command) and wait
    until its ready check passes, so every sandbox restored from the snapshot has it running."""
    start = record.start or (shlex.join(record.command) if record.command else None)
    how = runs_as(record)
    if start:
        # Detached, with its output in a file: it outlives this exec and the snapshot.
        script = f"( {start} ) </dev/null >>{START_LOG} 2>&1 &"
        r = await run(machine, ["/bin/sh", "-c", script], **how)
        if r.exit_code != 0:
            raise VMManagerError(f"template {record.name}: start failed: {r.stderr[:500].decode()}")
    if not record.ready:
        return
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        r = await run(machine, ["/bin/sh", "-c", record.ready], **how)
        if r.exit_code == 0:
            return
        if time.monotonic() > deadline:
            out = (r.stdout + r.stderr)[-500:].decode(errors="replace").strip()
            raise VMManagerError(
                f"template {record.name} was not ready after {READY_TIMEOUT_S:.0f} s "
                f"(ready check: exit {r.exit_code}: {out}; its start log is {START_LOG})"
            )
        await asyncio.sleep(0.2)
