"""The Firecracker VMM driver: microVMs through Firecracker's REST API, optionally jailed.

`driver` holds the `Driver`/`VM` pair, `client` the typed API client, `jailer` the jail's
command line and layout, `vsock` the hybrid-vsock handshake to reach the guest agent.
"""

from space.worker.vmm.firecracker.driver import AGENT_VSOCK_PORT, FirecrackerDriver, FirecrackerVM

__all__ = ["AGENT_VSOCK_PORT", "FirecrackerDriver", "FirecrackerVM"]
