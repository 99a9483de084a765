"""Where SPACE keeps things on a host.

Downloaded and built artifacts (kernels, template images) live under the cache directory so a
second build reuses them; per-VM runtime state (sockets, logs, disks) lives under the state
directory. Both can be moved with environment variables. Services read them once, into
`space.settings.Settings`; the image tools ask here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Artifacts that can be rebuilt: kernels, initramfs, template images."""
    env = os.environ if environ is None else environ
    return Path(env.get("SPACE_CACHE_DIR") or "/var/cache/space")


def state_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Runtime state of this host: the disk pool (VMs, snapshots), the embedded database."""
    env = os.environ if environ is None else environ
    return Path(env.get("SPACE_STATE_DIR") or "/var/lib/space")
