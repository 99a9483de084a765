"""SPACE's own Debian images: the default template `base`, a minimal Debian bookworm root
filesystem with python3, and others made the same way with more packages (`Flavor`).

Two cached stages, so that changing the image tweaks never repeats the download:
  1. `mmdebstrap` (minbase + python3 and a few tools, from the host's Debian mirror) into a
     tarball under `cache_dir()/mmdebstrap/<key>.tar.zst`;
  2. the tarball, unpacked and tweaked (hostname, hosts, no apt lists or caches, the flavor's
     own files), turned into a sparse ext4 image with `mkfs.ext4 -d` (no mount needed) under
     `cache_dir()/templates/<name>/<key>/rootfs.ext4`, next to its manifest.json.
The image is a template: sandboxes get reflinked copies of it, it is never written after build.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from space.paths import cache_dir
from space.worker.images import debs
from space.worker.images.debs import CacheSlot, ImageBuildError, Log, log_to_logging

SUITE = "bookworm"
VARIANT = "minbase"
# git: agents clone, commit and push in their sandboxes (E2B's SDK drives it from outside).
INCLUDE: tuple[str, ...] = ("python3", "ca-certificates", "iproute2", "procps", "util-linux",
                            "git")  # fmt: skip
# Documentation, manuals and translations are dead weight in a sandbox (a third of the size);
# dpkg keeps honouring these inside the sandbox too, for packages installed later.
DPKG_OPTIONS: tuple[str, ...] = (
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/locale/*",
    "path-include=/usr/share/locale/locale.alias",
    "path-exclude=/usr/share/lintian/*",
)
DEFAULT_SIZE = 1 << 30
LABEL = "space-root"
HOSTNAME = "space"
HOSTS = (
    "127.0.0.1\tlocalhost\n"
    f"127.0.1.1\t{HOSTNAME}\n"
    "::1\t\tlocalhost ip6-localhost ip6-loopback\n"
    "ff02::1\t\tip6-allnodes\n"
    "ff02::2\t\tip6-allrouters\n"
)
# mmdebstrap copies the build host's resolv.conf; the sandbox's resolver is set at run time.
RESOLV_CONF = "# The sandbox's resolver is configured when it starts.\n"
# Left-overs of the build that only cost space: apt's lists and package caches, logs.
CLEAN_GLOBS: tuple[str, ...] = (
    "var/lib/apt/lists/*",
    "var/cache/apt/*.bin",
    "var/cache/apt/archives/*.deb",
    "var/cache/debconf/*-old",
    "var/lib/dpkg/*-old",
    "var/log/apt/*",
    "var/log/*.log",
)
# Bump when stage 1 or stage 2 change in a way their other inputs do not show.
STAGE1_RECIPE = 1
STAGE2_RECIPE = 1


@dataclass(frozen=True)
class Flavor:
    """One of SPACE's images: its packages and the files of ours it carries."""

    name: str
    include: tuple[str, ...] = INCLUDE
    files: Callable[[], dict[str, bytes]] = dict  # path in the root -> content
    size_bytes: int = DEFAULT_SIZE
    recommends: bool = True  # apt's default; without, a scientific stack is a third the size


BASE = Flavor("base")


@dataclass(frozen=True)
class BaseTemplate:
    """A built image (`base` or another flavor); `size_bytes` is its (sparse) apparent size."""

    rootfs: Path
    size_bytes: int
    key: str


# --- the host's mirror -----------------------------------------------------------------------


def _host_sources() -> list[tuple[str, str, str]]:
    """(uri, suite, signed-by) of every `deb` entry the host's apt has, both file formats."""
    out: list[tuple[str, str, str]] = []
    apt = Path("/etc/apt")
    lists = [apt / "sources.list", *sorted((apt / "sources.list.d").glob("*.list"))]
    for path in lists:
        try:
            text = path.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            line = line.split("#", 1)[0].strip()
            m = re.match(r"^deb\s+(?:\[([^\]]*)\]\s+)?(\S+)\s+(\S+)", line)
            if m:
                opts = dict(o.split("=", 1) for o in (m.group(1) or "").split() if "=" in o)
                out.append((m.group(2), m.group(3), opts.get("signed-by", "")))
    for path in sorted((apt / "sources.list.d").glob("*.sources")):
        try:
            text = path.read_text()
        except OSError:
            continue
        for stanza in re.split(r"\n\s*\n", text):
            fields: dict[str, str] = {}
            for line in stanza.splitlines():
                if line.startswith("#") or ":" not in line or line[0].isspace():
                    continue
                k, _, v = line.partition(":")
                fields[k.strip().lower()] = v.strip()
            if "deb" not in fields.get("types", "").split():
                continue
            if fields.get("enabled", "yes").lower() == "no":
                continue
            for uri in fields.get("uris", "").split():
                for suite in fields.get("suites", "").split():
                    out.append((uri, suite, fields.get("signed-by", "")))
    return out


def mirror_lines(suite: str = SUITE) -> list[str]:
    """The host's apt sources for `suite` (and its -updates and -security) as mmdebstrap mirrors.

    Empty when the host has none: mmdebstrap then uses deb.debian.org by itself.
    """
    wanted = {suite, f"{suite}-updates", f"{suite}-security", f"{suite}/updates"}
    lines: list[str] = []
    for uri, s, signed_by in _host_sources():
        if s not in wanted:
            continue
        opt = f"[signed-by={signed_by}] " if signed_by.startswith("/") else ""
        line = f"deb {opt}{uri.rstrip('/')} {s} main"
        if line not in lines:
            lines.append(line)
    return lines


# --- stage 1: mmdebstrap ---------------------------------------------------------------------


def _stage1_key(mirrors: list[str], flavor: Flavor) -> str:
    return debs.fingerprint(
        {
            "recipe": STAGE1_RECIPE,
            "suite": SUITE,
            "variant": VARIANT,
            "include": list(flavor.include),
            "dpkgopt": list(DPKG_OPTIONS),
            "mirrors": mirrors,
            # Only where it differs from apt's default: `base` keeps its key.
            **({} if flavor.recommends else {"aptopt": list(_aptopts(flavor))}),
        }
    )


def _aptopts(flavor: Flavor) -> tuple[str, ...]:
    return () if flavor.recommends else ('Apt::Install-Recommends "false"',)


def _stage1(log: Log, force: bool, mirrors: list[str], flavor: Flavor) -> Path:
    """The mmdebstrap tarball, made unless cached (always made when `force`)."""
    key = _stage1_key(mirrors, flavor)
    root = cache_dir() / "mmdebstrap"
    tarball = root / f"{key}.tar.zst"
    if tarball.is_file() and not force:
        log(f"reusing the cached mmdebstrap output {tarball}")
        return tarball
    root.mkdir(parents=True, exist_ok=True)
    # Build under a name that still ends in .tar.zst: mmdebstrap picks the format from it.
    tmp = root / f".tmp-{key}.tar.zst"
    tmp.unlink(missing_ok=True)
    cmd: list[str] = [
        "mmdebstrap",
        f"--variant={VARIANT}",
        f"--include={','.join(flavor.include)}",
        *(f"--dpkgopt={opt}" for opt in DPKG_OPTIONS),
        *(f"--aptopt={opt}" for opt in _aptopts(flavor)),
        SUITE,
        str(tmp),
        *mirrors,
    ]
    log("$ " + shlex.join(cmd))
    started = time.monotonic()
    try:
        debs.run_streamed(cmd, log, what="mmdebstrap")
        tmp.rename(tarball)
    finally:
        tmp.unlink(missing_ok=True)
    took = time.monotonic() - started
    (root / f"{key}.json").write_text(
        json.dumps({"command": cmd, "seconds": round(took, 1), "key": key}, indent=2) + "\n"
    )
    log(f"mmdebstrap done in {took:.1f} s: {tarball} ({tarball.stat().st_size / 1e6:.1f} MB)")
    return tarball


# --- stage 2: the image ----------------------------------------------------------------------


def _tweak(rootdir: Path, files: dict[str, bytes]) -> None:
    (rootdir / "etc/hostname").write_text(HOSTNAME + "\n")
    (rootdir / "etc/hosts").write_text(HOSTS)
    resolv = rootdir / "etc/resolv.conf"
    if resolv.is_symlink() or resolv.exists():
        resolv.unlink()
    resolv.write_text(RESOLV_CONF)
    for pattern in CLEAN_GLOBS:
        for path in rootdir.glob(pattern):
            if path.is_dir() and not path.is_symlink():
                if path.name != "partial":  # apt expects its partial/ directories
                    shutil.rmtree(path)
            else:
                path.unlink()
    for name, content in files.items():
        path = rootdir / name.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)


def _dpkg_versions(rootdir: Path) -> dict[str, str]:
    versions: dict[str, str] = {}
    try:
        text = (rootdir / "var/lib/dpkg/status").read_text()
    except OSError:
        return versions
    for para in text.split("\n\n"):
        name = re.search(r"^Package: (\S+)", para, re.M)
        version = re.search(r"^Version: (\S+)", para, re.M)
        status = re.search(r"^Status: .* installed$", para, re.M)
        if name and version and status:
            versions[name.group(1)] = version.group(1)
    return versions


def _template(slot: CacheSlot, manifest: dict[str, object]) -> BaseTemplate:
    return BaseTemplate(
        rootfs=slot.path / "rootfs.ext4",
        size_bytes=int(str(manifest["size_bytes"])),
        key=slot.key,
    )


def base_root(name: str = BASE.name) -> Path:
    return cache_dir() / "templates" / name


def ensure_base_template(
    log: Log = log_to_logging, force: bool = False, *, size_bytes: int = DEFAULT_SIZE
) -> BaseTemplate:
    """The `base` template image, built unless a build of the same inputs is cached.

    `force` rebuilds both stages (a fresh mmdebstrap picks up new package versions).
    """
    return ensure_image(Flavor(BASE.name, size_bytes=size_bytes), log, force)


def ensure_image(flavor: Flavor, log: Log = log_to_logging, force: bool = False) -> BaseTemplate:
    """The flavor's image, built unless a build of the same inputs is cached."""
    started = time.monotonic()
    size_bytes = flavor.size_bytes
    if size_bytes < 64 << 20 or size_bytes % 4096:
        raise ImageBuildError(f"template size {size_bytes} must be a multiple of 4 KiB >= 64 MiB")
    mirrors = mirror_lines()
    stage1_key = _stage1_key(mirrors, flavor)
    files = flavor.files()
    key = debs.fingerprint(
        {
            "recipe": STAGE2_RECIPE,
            "stage1": stage1_key,
            "hostname": HOSTNAME,
            "hosts": HOSTS,
            "resolv": RESOLV_CONF,
            "clean": list(CLEAN_GLOBS),
            "size": size_bytes,
            "label": LABEL,
            # Only a flavor with files of its own adds them: `base` keeps its key.
            **({"files": {k: hashlib.sha256(v).hexdigest() for k, v in files.items()}}
               if files else {}),
        }
    )  # fmt: skip
    slot = CacheSlot(base_root(flavor.name), key)
    what = f"template {flavor.name}"
    if not force and (manifest := slot.load()) is not None:
        log(f"{what}: reusing cached build {slot.path}")
        return _template(slot, manifest)

    with slot.locked():
        if not force and (manifest := slot.load()) is not None:
            log(f"{what}: built meanwhile by another process")
            return _template(slot, manifest)
        tarball = _stage1(log, force, mirrors, flavor)
        tmp = slot.new_tmp()
        try:
            manifest = _build_image(tmp, tarball, flavor, files, log)
            manifest.update(
                key=key,
                stage1_key=stage1_key,
                stage1_tarball=str(tarball),
                build_seconds=round(time.monotonic() - started, 1),
            )
            slot.publish(tmp, manifest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    log(f"{what}: built {slot.path} in {manifest['build_seconds']} s")
    return _template(slot, manifest)


def _build_image(
    out: Path, tarball: Path, flavor: Flavor, files: dict[str, bytes], log: Log
) -> dict[str, object]:
    size_bytes = flavor.size_bytes
    rootdir = out / "root"
    rootdir.mkdir()
    log(f"unpacking {tarball.name}")
    debs.run_streamed(
        [
            "tar",
            "--zstd",
            "-xpf",
            tarball,
            "--numeric-owner",
            "--xattrs",
            "--xattrs-include=*",
            "-C",
            rootdir,
        ],
        log,
        what="tar",
    )
    _tweak(rootdir, files)
    packages = _dpkg_versions(rootdir)
    if "python3" not in packages:
        raise ImageBuildError("the mmdebstrap output has no python3 installed")
    image = out / "rootfs.ext4"
    log(f"mkfs.ext4 -d: {size_bytes >> 20} MiB sparse image, label {LABEL}")
    debs.run_streamed(
        ["mkfs.ext4", "-d", rootdir, "-L", LABEL, "-F", image, str(size_bytes // 1024) + "k"],
        log,
        what="mkfs.ext4",
    )
    shutil.rmtree(rootdir)
    st = image.stat()
    if st.st_size != size_bytes:
        raise ImageBuildError(f"mkfs.ext4 made a {st.st_size}-byte image, not {size_bytes}")
    allocated = st.st_blocks * 512
    log(f"rootfs.ext4: {size_bytes >> 20} MiB, {allocated / 1e6:.0f} MB allocated")
    return {
        "name": flavor.name,
        "suite": SUITE,
        "variant": VARIANT,
        "include": list(flavor.include),
        "label": LABEL,
        "size_bytes": size_bytes,
        "allocated_bytes": allocated,
        "python3": packages.get("python3.11", packages["python3"]),
        "packages": packages,
        "files": {"rootfs": "rootfs.ext4"},
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
