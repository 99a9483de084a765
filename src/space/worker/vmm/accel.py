"""Which acceleration QEMU gets on this host: KVM only where a real probe boot proves it works.

`/dev/kvm` existing proves nothing: under some nested hypervisors a Linux guest crawls for a
minute and then dies with an emulation failure. The probe boots our own kernel and initramfs
with no root disk under KVM; a working KVM reaches the init's "no root device" message within
seconds. The answer is cached per host kernel and guest kernel (see `cached`).
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
NO_DEVICE = "/dev/kvm is missing or not accessible"


def _cache_file() -> Path:
    return paths.cache_dir() / "accel.json"


def probe_kvm(kernel: Path, initrd: Path, qemu: str = "qemu-system-x86_64") -> tuple[bool, str]:
    """Boot the guest kernel under KVM without a disk; (works, why)."""
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False, NO_DEVICE
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


def cached(kernel_key: str) -> tuple[str, str] | None:
    """The cached (accel, why) that holds for this guest kernel on this host, if any.

    A probe of another guest kernel on the same host kernel that ended in TCG holds too (the
    release before or after this one, whose worker ran here): KVM that fails a guest fails for
    the host's reasons, and probing again would hold a restarting worker for the probe's whole
    timeout, past the time its sandboxes' control plane waits for it. Not when /dev/kvm has
    appeared since."""
    host = os.uname().release
    try:
        known = json.loads(_cache_file().read_text())
        key, accel, why = str(known["key"]), str(known["accel"]), str(known.get("why") or "")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if key == f"{host}/{kernel_key}":
        return accel, why
    appeared = why.startswith(NO_DEVICE) and os.access("/dev/kvm", os.R_OK | os.W_OK)
    if accel == "tcg" and key.split("/", 1)[0] == host and not appeared:
        return accel, why
    return None


def choose_accel(kernel: Path, initrd: Path, kernel_key: str, forced: str = "auto") -> str:
    """ "kvm" or "tcg"; `forced` (SPACE_ACCEL) picks one without a probe."""
    if forced in ("kvm", "tcg"):
        return forced
    if (known := cached(kernel_key)) is not None:
        return known[0]
    works, why = probe_kvm(kernel, initrd)
    accel = "kvm" if works else "tcg"
    log.warning("acceleration: %s (%s)", accel, why)
    cache = _cache_file()
    cache.parent.mkdir(parents=True, exist_ok=True)
    key = f"{os.uname().release}/{kernel_key}"
    cache.write_text(json.dumps({"key": key, "accel": accel, "why": why}))
    return accel
