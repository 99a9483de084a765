"""A jailed VMM joins the network namespace of its tap, so a tap in the host's own namespace
would hand the VMM the host's network: the driver refuses it before anything starts."""

from __future__ import annotations

import asyncio
import os
import secrets
import threading

import pytest
from pyroute2 import IPRoute

from space.worker.local import LocalRuntime
from space.worker.network import netns as nsutil
from space.worker.network.manager import open_tap_device
from space.worker.vmm.base import VMConfig, VMMError
from space.worker.vmm.qemu import QemuDriver, _in_host_namespace
from tests.vm.conftest import vmm_pids

pytestmark = pytest.mark.vm


def _delete_link(name: str) -> None:
    with IPRoute() as ipr:
        for index in ipr.link_lookup(ifname=name):
            ipr.link("del", index=index)


async def test_a_tap_in_the_host_namespace_is_refused(runtime: LocalRuntime) -> None:
    driver = runtime.driver
    assert isinstance(driver, QemuDriver) and driver.jail is not None, "jailed by default"
    tap = f"sh{secrets.token_hex(4)}"
    vm_id = f"tap-{secrets.token_hex(4)}"
    run_dir = runtime.pool.vms / vm_id
    config = VMConfig(
        vm_id=vm_id, kernel=runtime.images.kernel, initrd=runtime.images.initrd,
        rootfs=runtime.images.rootfs, tap_device=tap, guest_mac="02:00:00:00:00:42",
    )  # fmt: skip
    before = vmm_pids(runtime.pool.vms)
    try:
        with pytest.raises(VMMError, match="host's network namespace"):
            await driver.boot(config, run_dir)
    finally:
        await asyncio.to_thread(_delete_link, tap)
    assert vmm_pids(runtime.pool.vms) == before, "no VMM was started"


def test_the_check_sees_the_worker_namespace_from_any_thread() -> None:
    """The worker opens taps on threads that entered a sandbox's namespace: the host's own is
    judged by the process, not by the thread asking."""
    name = f"tapns-{secrets.token_hex(3)}"
    results: list[bool] = []

    def inside() -> None:
        fd = open_tap_device("t0")
        try:
            results.append(_in_host_namespace(fd))
        finally:
            os.close(fd)

    def host() -> None:
        fd = open_tap_device(f"th{secrets.token_hex(3)}")
        try:
            results.append(_in_host_namespace(fd))
        finally:
            os.close(fd)

    nsutil.create(name, inside)
    try:
        thread = threading.Thread(target=host)
        thread.start()
        thread.join()
    finally:
        nsutil.remove(name)
    assert results == [False, True]
