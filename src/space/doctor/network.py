"""What every sandbox's network is made of (space.worker.network): a network namespace with a
veth pair, and nftables rules in it and on the host. Both are tried for real, with the worker's
own code and rule sets, in a namespace made for the purpose and removed after."""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Callable

from pyroute2 import IPRoute  # type: ignore[import-untyped]
from pyroute2.netlink.exceptions import NetlinkError  # type: ignore[import-untyped]

from space.doctor.host import Host
from space.doctor.model import Check
from space.worker.network import netns, rules

NOT_NEEDED = "not needed: SPACE_WORKER_NETWORK=0 gives VMs no NIC"
NETWORK_MEANS = (
    "Every sandbox's traffic goes through a namespace of its own: no sandbox can start with a "
    "network (SPACE_WORKER_NETWORK=0 runs VMs without any NIC instead)."
)
DOCTOR_TABLE = "space_doctor"


def _in_throwaway_namespace(work: Callable[[], None]) -> None:
    """Run `work` in a new network namespace (with the sandbox's two links), then remove it."""

    def inside() -> None:
        with IPRoute() as ipr:
            ipr.link("add", ifname=rules.GUEST_LINK, kind="veth", peer=rules.HOST_LINK)
        work()

    name = f"spdoctor-{secrets.token_hex(4)}"
    try:
        netns.create(name, inside)
    finally:
        netns.remove(name)


def check_netns(host: Host) -> Check:
    if not host.network:
        return Check("netns", "ok", NOT_NEEDED)
    try:
        _in_throwaway_namespace(lambda: None)
    except (OSError, NetlinkError) as e:
        return Check(
            "netns", "fail", f"cannot make a network namespace with a veth pair: {e}",
            NETWORK_MEANS,
            "run as root; a kernel with network namespaces and veth (`modprobe veth`); "
            "/run must be writable (namespaces are mounted at /run/netns)",
        )  # fmt: skip
    return Check("netns", "ok", "a network namespace with a veth pair is made and removed")


def check_nftables(host: Host) -> Check:
    if not host.network:
        return Check("nftables", "ok", NOT_NEEDED)
    if shutil.which("nft") is None:
        return Check("nftables", "fail", "nft is not installed", NETWORK_MEANS,
                     "`apt-get install nftables`")  # fmt: skip

    def load_and_delete() -> None:
        rules.nft(rules.sandbox_ruleset("10.128.0.1"))
        rules.nft(rules.host_ruleset(DOCTOR_TABLE, "sp-*", "10.128.0.0/16", 15001, 15053))
        rules.nft(f"delete table inet {DOCTOR_TABLE}\ndelete table inet space\n"
                  "delete table netdev space_guard\n")  # fmt: skip

    try:
        _in_throwaway_namespace(load_and_delete)
    except rules.NetworkError as e:
        return Check(
            "nftables", "fail", f"the worker's rules do not load: {e}", NETWORK_MEANS,
            "a kernel with nftables, NAT and netdev ingress (`modprobe nf_tables nft_nat "
            "nft_redir nft_masq`; Debian's kernels have them)",
        )  # fmt: skip
    except (OSError, NetlinkError) as e:
        return Check("nftables", "fail", f"cannot make a namespace to try nft in: {e}",
                     NETWORK_MEANS, "see the netns check")  # fmt: skip
    return Check("nftables", "ok", "the worker's rule sets load and delete in a namespace")
