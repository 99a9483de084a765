"""Where SPACE keeps things on a host.

Downloaded and built artifacts (kernels, template images) live under the cache directory so a
second build reuses them; per-VM runtime state (sockets, logs, disks) lives under the state
directory. Both can be moved with environment variables.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Artifacts that can be rebuilt: kernels, initramfs, template images."""
    return Path(os.environ.get("SPACE_CACHE_DIR", "/var/cache/space"))


def state_dir() -> Path:
    """Runtime state of this host: the disk pool (VMs, snapshots), the embedded database."""
    return Path(os.environ.get("SPACE_STATE_DIR", "/var/lib/space"))
