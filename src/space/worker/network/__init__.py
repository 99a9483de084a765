"""Per-sandbox network plumbing: namespace, tap, veth pair to the host, nftables rules."""

from space.worker.network.egress import Egress
from space.worker.network.manager import NetworkConfig, NetworkManager, SandboxNetwork
from space.worker.network.rules import GATEWAY_IP, GUEST_IP, GUEST_MAC, NetworkError

__all__ = [
    "GATEWAY_IP",
    "GUEST_IP",
    "GUEST_MAC",
    "Egress",
    "NetworkConfig",
    "NetworkError",
    "NetworkManager",
    "SandboxNetwork",
]
