"""`space doctor`: can this host run SPACE, and if not, what to do about it.

Each check (`run.CHECKS`) looks at one need — KVM that really boots a guest, /dev/net/tun, loop
devices, a pool that clones copy-on-write, namespaces and nftables, cgroups v2, QEMU, the image
tools, memory, disk, root — by trying it where it can, and answers a `Check`: ok, warn (SPACE
works, degraded) or fail (it cannot), what that means for SPACE and the fix. It reuses the
worker's own code (its KVM probe, its pool's reflink, its namespace and nftables code) and
never touches the database or the API.
"""

from space.doctor.host import Host, HostPaths
from space.doctor.model import Check, Status, worst
from space.doctor.run import CHECKS, run_checks

__all__ = ["CHECKS", "Check", "Host", "HostPaths", "Status", "run_checks", "worst"]
