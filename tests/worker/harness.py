"""What the worker tests share: a VMManager on this host's runtime, free ports."""

from __future__ import annotations

import socket

from space.worker.local import LocalRuntime
from space.worker.sandboxes import ManagerOptions, VMManager


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def manager(runtime: LocalRuntime, worker_id: str, capacity_vcpus: int = 8) -> VMManager:
    return VMManager(
        runtime.driver, runtime.pool, runtime.images, worker_id,
        ManagerOptions(capacity_vcpus=capacity_vcpus, capacity_memory_mib=4096, reserve_mib=1024,
                       reconcile_grace_s=0),
    )  # fmt: skip
