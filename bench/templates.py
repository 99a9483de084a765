"""Templates and storage benchmark: disk clones (reflink vs full copy), builds (cold vs cached).

Every figure has its baseline in the same run:
  - cloning a 1 GiB template image in the worker's btrfs pool by reflink (FICLONE)  vs  a full
    copy of it (`cp --reflink=never`, then fsync, so the copy is really written) on the same
    file system; once for an image whose 1 GiB is all data and once for the `base` template
    (1 GiB sparse, mostly holes), with the extra disk space each clone costs (btrfs's own
    accounting: `btrfs filesystem du`, exclusive bytes)
  - a template build with 3 steps, cold (empty cache)  vs  the same spec with step 3 changed
    (steps 1-2 from the cache)  vs  the same spec again (all cached), with the build VM's boot
    in each (the disk steps share one VM; a step used to cost a boot); from `debian:bookworm`
    (the base image as it is) and from an OCI layout of the same root (one 52 MB zstd layer, so
    the cold build unpacks it and makes the ext4 image)

Run as root:  .venv/bin/python bench/templates.py [--clones 20] [--copies 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import vm_runtime
from space.worker.images.base import base_root, ensure_base_template
from space.worker.local import LocalRuntime, local_runtime
from space.worker.storage.reflink import reflink
from space.worker.templates import BuildEnv, build_template, parse_spec

GIB = 1 << 30


def percentiles(samples: list[float]) -> dict[str, float]:
    return {**vm_runtime.percentiles(samples), "max_ms": max(samples) * 1000}


def exclusive_bytes(path: Path) -> int:
    """Bytes of `path` that no other file shares, by btrfs's own accounting."""
    out = subprocess.run(
        ["btrfs", "filesystem", "du", "--raw", str(path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()[-1]
    return int(out.split()[1])


def full_copy(src: Path, dst: Path) -> None:
    subprocess.run(["cp", "--reflink=never", "--sparse=always", str(src), str(dst)], check=True)
    fd = os.open(dst, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def clone_bench(src: Path, work: Path, clones: int, copies: int) -> dict[str, Any]:
    reflinks: list[float] = []
    for i in range(clones):
        dst = work / f"reflink-{i}"
        t = time.perf_counter()
        reflink(src, dst)
        reflinks.append(time.perf_counter() - t)
    subprocess.run(["sync", "-f", str(work)], check=True)
    reflink_extra = exclusive_bytes(work / "reflink-0")
    fulls: list[float] = []
    for i in range(copies):
        dst = work / f"copy-{i}"
        t = time.perf_counter()
        full_copy(src, dst)
        fulls.append(time.perf_counter() - t)
    copy_extra = exclusive_bytes(work / "copy-0")
    for p in work.iterdir():
        if p.name.startswith(("reflink-", "copy-")):
            p.unlink()
    return {
        "image_bytes": src.stat().st_size,
        "allocated_bytes": src.stat().st_blocks * 512,
        "reflink": percentiles(reflinks),
        "full_copy": percentiles(fulls),
        "reflink_exclusive_bytes": reflink_extra,
        "full_copy_exclusive_bytes": copy_extra,
    }


SPEC = """
[template]
name = "bench"
from = "{source}"

[[steps]]
run = "head -c 20000000 /dev/urandom > /opt/blob && echo {nonce} > /opt/nonce"

[[steps]]
copy = {{ src = "app/", dst = "/app" }}

[[steps]]
run = "echo {last} > /app/last"
"""


def write_oci_layout(dest: Path) -> None:
    """An OCI layout of the `base` Debian root: its mmdebstrap tarball as one zstd layer."""
    base = ensure_base_template()
    manifest = json.loads((base_root() / base.key / "manifest.json").read_text())
    layer = Path(manifest["stage1_tarball"]).read_bytes()
    config = json.dumps({"architecture": "amd64", "os": "linux", "config": {}}).encode()
    blobs = dest / "blobs/sha256"
    blobs.mkdir(parents=True)

    def put(data: bytes) -> dict[str, Any]:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return {"digest": f"sha256:{digest}", "size": len(data)}

    image = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **put(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+zstd", **put(layer)}],
    }
    index = {"schemaVersion": 2, "manifests": [{"mediaType": image["mediaType"], **put(
        json.dumps(image).encode())}]}  # fmt: skip
    (dest / "index.json").write_text(json.dumps(index))
    (dest / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')


async def build_bench(rt: LocalRuntime, root: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        ctx = Path(tmp)
        (ctx / "app").mkdir()
        (ctx / "app/main.py").write_text("print('bench')\n")
        write_oci_layout(ctx / "layout")
        out: dict[str, Any] = {}
        for source in ("debian:bookworm", "oci-layout:layout"):
            env = BuildEnv.from_runtime(rt, root / source.partition(":")[0])
            nonce = uuid.uuid4().hex  # a cache no earlier run can have filled
            runs: dict[str, Any] = {}
            for label, last in (("cold", "v1"), ("step_3_changed", "v2"), ("unchanged", "v2")):
                lines: list[str] = []

                def log(line: str, lines: list[str] = lines) -> None:
                    lines.append(line)
                    print(f"  {line}", file=sys.stderr)

                spec = parse_spec(SPEC.format(source=source, nonce=nonce, last=last), ctx)
                t = time.perf_counter()
                await build_template(spec, env, log)
                took = time.perf_counter() - t
                cached = sorted(
                    {int(m.group(1)) for ln in lines if (m := re.match(r"step (\d+): cached", ln))}
                )
                boots = [float(m.group(1)) for ln in lines
                         if (m := re.search(r"build VM: booted in ([\d.]+) s", ln))]  # fmt: skip
                runs[label] = {"seconds": round(took, 2), "cached_steps": cached,
                               "vm_boots": len(boots), "vm_boot_seconds": boots}  # fmt: skip
                print(f"build {source} {label}: {took:.1f} s, cached {cached}", file=sys.stderr)
            out[source] = runs
        return out


def table(results: dict[str, Any]) -> str:
    lines = ["disk clone of a 1 GiB template image in the btrfs pool (p50 / max):"]
    for name in ("dense_1gib", "base_template"):
        r = results["clone"][name]
        lines.append(
            f"  {name:<14} ({r['allocated_bytes'] / 1e6:6.0f} MB data): "
            f"reflink {r['reflink']['p50_ms']:8.2f} / {r['reflink']['max_ms']:8.2f} ms, "
            f"+{r['reflink_exclusive_bytes'] / 1e6:.1f} MB on disk   |   "
            f"full copy {r['full_copy']['p50_ms']:8.0f} / {r['full_copy']['max_ms']:8.0f} ms, "
            f"+{r['full_copy_exclusive_bytes'] / 1e6:.0f} MB on disk"
        )
    for source, b in results["build"].items():
        lines.append(f"template build, {source} + 3 steps (the disk steps in one build VM, TCG):")
        for key in ("cold", "step_3_changed", "unchanged"):
            boots = ", ".join(f"{t:.1f} s" for t in b[key]["vm_boot_seconds"]) or "none"
            lines.append(
                f"  {key:<15} {b[key]['seconds']:7.1f} s   cached steps: {b[key]['cached_steps']}"
                f"   build VM boots: {boots}"
            )
    return "\n".join(lines)


async def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--clones", type=int, default=20)
    parser.add_argument("--copies", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    rt = await local_runtime(log=lambda line: print(line, file=sys.stderr))
    if not rt.pool.reflinks:
        sys.exit(f"the pool {rt.pool.root} cannot reflink: this benchmark needs btrfs or XFS")
    work = rt.pool.root / "bench-templates" / uuid.uuid4().hex[:8]
    work.mkdir(parents=True)
    results: dict[str, Any] = {"clone": {}}
    try:
        dense = work / "dense.img"
        with dense.open("wb") as f:
            chunk = os.urandom(1 << 20)
            for _ in range(GIB >> 20):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        print("cloning a dense 1 GiB image", file=sys.stderr)
        results["clone"]["dense_1gib"] = clone_bench(dense, work, args.clones, args.copies)
        dense.unlink()
        print("cloning the base template image", file=sys.stderr)
        results["clone"]["base_template"] = clone_bench(
            rt.images.rootfs, work, args.clones, args.copies
        )
        results["build"] = await build_bench(rt, work / "build")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results["host"] = {
        "accel": rt.driver.accel,
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "pool": str(rt.pool.root),
    }
    print(table(results))
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
