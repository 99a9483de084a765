from __future__ import annotations

import os

import pytest

from space.worker.local import LocalRuntime, local_runtime


@pytest.fixture(scope="module")
async def runtime() -> LocalRuntime:
    if os.geteuid() != 0:
        pytest.fail("the worker tests need root (loop devices, btrfs, QEMU)")
    return await local_runtime()
