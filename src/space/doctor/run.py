"""Every check, in the order a person reads them, and running them."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from space.doctor.devices import check_loop, check_tun
from space.doctor.host import Host
from space.doctor.kvm import check_kvm
from space.doctor.model import Check
from space.doctor.network import check_netns, check_nftables
from space.doctor.storage import check_cache_space, check_pool, check_pool_space
from space.doctor.system import (
    check_cgroups,
    check_firecracker,
    check_image_tools,
    check_memory,
    check_qemu,
    check_root,
)
from space.settings import Settings

log = logging.getLogger(__name__)

CHECKS: dict[str, Callable[[Host], Check]] = {
    "root": check_root,
    "kvm": check_kvm,
    "qemu": check_qemu,
    "firecracker": check_firecracker,
    "tun": check_tun,
    "loop": check_loop,
    "pool": check_pool,
    "netns": check_netns,
    "nftables": check_nftables,
    "cgroups": check_cgroups,
    "memory": check_memory,
    "disk.pool": check_pool_space,
    "disk.cache": check_cache_space,
    "tools": check_image_tools,
}


def run_checks(host: Host | None = None, only: Iterable[str] = ()) -> list[Check]:
    """The checks named in `only` (all of them if empty), each run once on `host`."""
    host = host or Host.from_settings(Settings.from_env())
    wanted = list(only) or list(CHECKS)
    unknown = [name for name in wanted if name not in CHECKS]
    if unknown:
        raise ValueError(f"no check {', '.join(unknown)}; there are: {', '.join(CHECKS)}")
    results = []
    for name in wanted:
        try:
            results.append(CHECKS[name](host))
        except Exception as e:
            # A check that cannot even run says so, instead of hiding every other answer.
            log.debug("check %s", name, exc_info=True)
            results.append(Check(name, "fail", f"the check itself failed: {e!r}",
                                 "This is a fault in `space doctor`, or a very unusual host.",
                                 "run `space -v doctor` and report what it prints"))  # fmt: skip
    return results
