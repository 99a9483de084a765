"""Which acceleration QEMU gets on this host: KVM only where a real probe boot proves it works.

`/dev/kvm` existing proves nothing: under some nested hypervisors a Linux guest crawls for a
minute and then dies with an emulation failure. The probe boots our own kernel and initramfs
with no root disk under KVM; a working KVM reaches the init's "no root device" message within
seconds. The answer is cached per host kernel and guest kernel.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import tempfile
import time
from pathlib import Path

from space import paths

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 20.0
PROBE_MARKER = "space-init:"


def _cache_file() -> Path:
    return paths.cache_dir() / "accel.json"


def probe_kvm(kernel: Path, initrd: Path, qemu: str = "qemu-system-x86_64") -> tuple[bool, str]:
    """Boot the guest kernel under KVM without a disk; (works, why)."""
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False, "/dev/kvm is missing or not accessible"
    with tempfile.TemporaryDirectory(prefix="space-kvm-probe-") as tmp:
        console = Path(tmp) / "console.log"
        argv = [
            qemu, "-M", "microvm,isa-serial=on", "-accel", "kvm", "-cpu", "max", "-m", "128",
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            "-kernel", str(kernel), "-initrd", str(initrd),
            "-append", "console=ttyS0 panic=-1 root=/dev/nonexistent",
            "-serial", f"file:{console}",
        ]  # fmt: skip
        started = time.monotonic()
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            while time.monotonic() - started < PROBE_TIMEOUT_S:
                text = console.read_text(errors="replace") if console.exists() else ""
                if PROBE_MARKER in text:
                    return True, f"a KVM guest reached init in {time.monotonic() - started:.1f}s"
                if proc.poll() is not None:
                    err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
                    return False, f"QEMU with KVM exited early: {err or 'no message'}"
                time.sleep(0.1)
            return False, f"a KVM guest did not reach init within {PROBE_TIMEOUT_S:.0f}s"
        finally:
            proc.kill()
            proc.wait()


def choose_accel(kernel: Path, initrd: Path, kernel_key: str, forced: str = "auto") -> str:
    """ "kvm" or "tcg"; `forced` (SPACE_ACCEL) picks one without a probe."""
    if forced in ("kvm", "tcg"):
        return forced
    key = f"{os.uname().release}/{kernel_key}"
    cache = _cache_file()
    try:
        known = json.loads(cache.read_text())
        if known.get("key") == key:
            return str(known["accel"])
    except (OSError, ValueError, KeyError):
        pass
    works, why = probe_kvm(kernel, initrd)
    accel = "kvm" if works else "tcg"
    log.warning("acceleration: %s (%s)", accel, why)
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"key": key, "accel": accel, "why": why}))
    return accel
