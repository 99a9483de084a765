"""Exhaustion attacks from inside a sandbox harm only that sandbox: a memory hog meets its own
VM's limit, a fork bomb fills only its own guest, and the neighbours keep answering."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from space.settings import Shares
from space.worker.network import rules

from ..stack import Platform
from ..vm.conftest import vmm_pids
from .helpers import create, exec_events, run, run_argv

POOL = Path("/var/lib/space/pool/workers")


def test_memory_and_fork_exhaustion_stay_in_their_sandbox(platform: Platform) -> None:
    with platform.client() as c:
        neighbour = create(c)
        hog = create(c, memory_mib=256)
        # Memory: the guest's own limit stops it (MemoryError or its OOM killer), nothing else.
        grab = "l = []\nwhile True: l.append(bytearray(32 << 20))"
        _, _, code = run(c, hog["id"], f"python3 -c '{grab}'")
        assert code != 0
        out, _, _ = run(c, hog["id"], "echo still-here")
        assert out == b"still-here\n"  # its agent (PID 1, never the OOM killer's) survived

        # A fork bomb, cut short: the guest fills up; the neighbour answers throughout.
        events = exec_events(c, hog["id"], cmd="b(){ b | b & }; b", timeout=5)
        assert events[-1]["type"] in ("exit", "error")
        for _ in range(3):
            out, _, code = run(c, neighbour["id"], "echo fine")
            assert (out, code) == (b"fine\n", 0)

        # Deleting the exhausted sandbox still works and leaves no process behind.
        r = c.delete(f"/v1/sandboxes/{hog['id']}")
        assert r.status_code == 200 and r.json()["state"] == "deleted", r.text
        assert not [p for w in platform.workers for p in vmm_pids(POOL / w / "vms" / hog["id"])]
        c.delete(f"/v1/sandboxes/{neighbour['id']}")


# Stands in for every program the worker might run in a guest: it leaves a mark on the volume
# and floods whoever reads its output.
HOSTILE = """#!/usr/bin/python3
import os, sys
with open("/data/pwned", "a") as f:
    f.write(sys.argv[0] + "\\n")
os.write(1, b"x" * (64 << 20))
"""
REPLACED = ["/usr/local/bin/sync", "/usr/local/sbin/umount", "/usr/local/sbin/mount",
            "/usr/local/sbin/resize2fs", "/usr/bin/sync", "/usr/bin/umount", "/usr/bin/mount",
            "/usr/sbin/resize2fs", "/usr/bin/cat", "/usr/bin/cp", "/bin/sh"]  # fmt: skip


def test_the_worker_runs_no_program_of_the_guest_for_itself(platform: Platform) -> None:
    """A tenant replaces sync, mount, umount, resize2fs, cat, cp and sh in its sandbox: suspend,
    resume and delete (which flush, unmount and snapshot) still work, none of those programs
    runs, and the volume's data is flushed by the agent's own calls."""
    with platform.client() as c:
        r = c.post("/v1/volumes", json={"name": "duties", "size_mib": 64})
        assert r.status_code == 201, r.text
        vol = r.json()["id"]
        attach = {"volume": vol, "path": "/data"}
        sb = create(c, volumes=[attach], disk_mib=2048)
        sid = sb["id"]
        assert sb["state"] == "running", sb
        plant = "; ".join(f"install -D -m 755 /tmp/hostile {p}" for p in REPLACED if p != "/bin/sh")
        # cp before cp is replaced (the hostile one would leave its mark).
        first = "echo kept > /data/note; cp /tmp/hostile /usr/bin/sh.new"
        _, err, code = run(c, sid, f"cat > /tmp/hostile <<'EOF'\n{HOSTILE}EOF\n{first}; {plant}")
        assert code == 0, err
        # The last one by rename within its directory: an exec of sh is not needed for it.
        swap = ["/usr/bin/python3", "-c", "import os; os.replace('/usr/bin/sh.new', '/bin/sh')"]
        _, err, code = run_argv(c, sid, swap)
        assert code == 0, err

        assert c.post(f"/v1/sandboxes/{sid}/suspend").json()["state"] == "suspended"
        assert c.post(f"/v1/sandboxes/{sid}/resume").json()["state"] == "running"
        look = ["/usr/bin/python3", "-c", "import os; print(os.path.exists('/data/pwned'))"]
        assert run_argv(c, sid, look)[0] == b"False\n"
        assert c.delete(f"/v1/sandboxes/{sid}").json()["state"] == "deleted"

        # The volume, attached elsewhere: flushed by the agent's unmount, and never marked.
        other = create(c, volumes=[attach])
        out, err, code = run(c, other["id"], "cat /data/note; ls /data")
        assert code == 0, err
        assert out.split() == [b"kept", b"lost+found", b"note"], out
        c.delete(f"/v1/sandboxes/{other['id']}")
        c.delete(f"/v1/volumes/{vol}")


def _status(pid: int) -> dict[str, str]:
    text = Path(f"/proc/{pid}/status").read_text()
    return {k: v.strip() for k, v in (line.split(":", 1) for line in text.splitlines())}


def test_every_vmm_runs_jailed(platform: Platform) -> None:
    """Each sandbox's VMM (a created one and a warm pool's restore alike) runs as a uid of its
    own with no capabilities, no_new_privs, a seccomp filter, and namespaces and a cgroup that
    are not the host's nor another VMM's."""
    with platform.client() as c:
        made = [create(c), create(c, memory_mib=384)]
        pids = [p for w in platform.workers for sb in made
                for p in vmm_pids(POOL / w / "vms" / sb["id"])]  # fmt: skip
        assert len(pids) == len(made)
        host_mnt = os.readlink("/proc/self/ns/mnt")
        seen: dict[str, set[str]] = {"uid": set(), "mnt": set(), "cgroup": set()}
        for pid in pids:
            st = _status(pid)
            uid = st["Uid"].split()
            assert uid[0] != "0" and len(set(uid)) == 1, st["Uid"]
            assert st["CapEff"] == st["CapPrm"] == st["CapBnd"] == "0000000000000000"
            assert st["NoNewPrivs"] == "1" and st["Seccomp"] == "2"
            mnt = os.readlink(f"/proc/{pid}/ns/mnt")
            assert mnt != host_mnt
            cgroups = {line.split(":", 2)[2] for line in
                       Path(f"/proc/{pid}/cgroup").read_text().splitlines()}  # fmt: skip
            own = {g for g in cgroups if g.startswith("/space/vm-")}
            assert own, cgroups
            # Its root holds the distribution's /usr, a few device nodes and its own VM's
            # files: no /proc, no /etc beyond the loader's cache.
            root = Path(f"/proc/{pid}/root")
            assert not (root / "proc/self").exists() and not (root / "etc/shadow").exists()
            seen["uid"].add(uid[0])
            seen["mnt"].add(mnt)
            seen["cgroup"] |= own
        assert all(len(v) == len(made) for v in seen.values()), seen
        for sb in made:
            c.delete(f"/v1/sandboxes/{sb['id']}")


def test_every_sandbox_gets_its_fair_share(platform: Platform) -> None:
    """Each VMM's drives are throttled together and each sandbox network shapes both ways, at
    the worker's shares (their defaults here), which `/v1/workers` and `space admin workers`
    show."""
    shares = Shares()
    with platform.client() as c, platform.client(platform.admin_key) as admin:
        sb = create(c)
        worker = sb["worker_id"]  # a test before may have added a worker
        (pid,) = vmm_pids(POOL / worker / "vms" / sb["id"])
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        drives = [a for a in argv if a.startswith("id=root,") or a.startswith("id=drive")]
        assert drives, argv
        for drive in drives:
            assert f"throttling.bps-total={shares.disk_mib_s << 20}" in drive, drive
            assert f"throttling.iops-total={shares.disk_iops}" in drive, drive
            assert "throttling.group=disk" in drive, drive
        netns = f"space-{worker}-{sb['id']}"
        for link in (rules.GUEST_LINK, rules.HOST_LINK):
            qdisc = subprocess.run(["tc", "-n", netns, "qdisc", "show", "dev", link],
                                   capture_output=True, text=True, check=True).stdout  # fmt: skip
            assert "tbf 1: root" in qdisc and f"rate {shares.net_mbit}Mbit" in qdisc, qdisc
        deadline = time.monotonic() + 30  # the controller's next probe records them
        while True:
            listed = {w["id"]: w for w in admin.get("/v1/workers").json()["items"]}
            if listed[worker]["shares"]["net_mbit"] or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert listed[worker]["shares"] == asdict(shares)
        out = subprocess.run(
            [sys.executable, "-m", "space.cli.main", "admin", "workers"], env=platform.env,
            capture_output=True, text=True, timeout=60, check=True, stdin=subprocess.DEVNULL,
        ).stdout  # fmt: skip
        expected = (f"{shares.disk_mib_s} MiB/s {shares.disk_iops} IOPS, "
                    f"{shares.net_mbit} Mbit/s")  # fmt: skip
        assert expected in out, out
        c.delete(f"/v1/sandboxes/{sb['id']}")
