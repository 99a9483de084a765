"""What the worker calls: a sandbox's network and its gateway policy, made and removed together.

egress = Egress(NetworkManager(config), gateway_client)
await egress.start({id: policy for every live sandbox})   # worker start, gateway (re)start
net = await egress.attach(id, policy)     # before the VM starts; then QEMU on the tap fd
await egress.set_policy(id, policy)       # while it runs
await egress.detach(id)                   # after the VMM has exited
await egress.reinstall()                  # after the gateway restarted (it kept nothing)
"""

from __future__ import annotations

from collections.abc import Mapping

from space.gateway.client import GatewayClient
from space.gateway.policy import Policy
from space.worker.network.manager import NetworkManager, SandboxNetwork
from space.worker.network.rules import NetworkError


class Egress:
    def __init__(self, manager: NetworkManager, gateway: GatewayClient) -> None:
        self.manager = manager
        self.gateway = gateway
        self._nets: dict[str, SandboxNetwork] = {}
        self._policies: dict[str, Policy] = {}  # what each network has in force

    async def start(self, live: Mapping[str, Policy]) -> list[str]:
        """Load host rules, keep (or rebuild) the networks of `live` sandboxes and push their
        policies (the gateway keeps none across restarts); remove every other network. Returns
        the ids whose network had to be rebuilt (their VMs need a new tap fd)."""
        adopted = {net.sandbox_id: net for net in await self.manager.start(keep=live)}
        rebuilt = []
        for sandbox_id, policy in live.items():
            net = adopted.get(sandbox_id)
            if net is None:
                net = await self.manager.create(sandbox_id)
                rebuilt.append(sandbox_id)
            self._nets[sandbox_id] = net
            await self.gateway.set_policy(sandbox_id, net.sandbox_ip, policy)
            self._policies[sandbox_id] = policy
        return rebuilt

    async def reinstall(self) -> None:
        """Every network's policy again, into a gateway that restarted with none."""
        for sandbox_id, net in list(self._nets.items()):
            policy = self._policies.get(sandbox_id, Policy())
            await self.gateway.set_policy(sandbox_id, net.sandbox_ip, policy)

    async def attach(self, sandbox_id: str, policy: Policy) -> SandboxNetwork:
        """The sandbox's network with its policy in force; idempotent (a retried create or a
        restore finds it). Nothing is left behind if it fails."""
        net = self._nets.get(sandbox_id) or await self.manager.adopt(sandbox_id)
        if net is None:
            net = await self.manager.create(sandbox_id)
        try:
            await self.gateway.set_policy(sandbox_id, net.sandbox_ip, policy)
        except BaseException:
            await self.detach(sandbox_id)
            raise
        self._nets[sandbox_id] = net
        self._policies[sandbox_id] = policy
        return net

    async def set_policy(self, sandbox_id: str, policy: Policy) -> None:
        net = self._nets.get(sandbox_id)
        if net is None:
            raise NetworkError(f"sandbox {sandbox_id} has no network on this worker")
        await self.gateway.set_policy(sandbox_id, net.sandbox_ip, policy)
        self._policies[sandbox_id] = policy

    def network(self, sandbox_id: str) -> SandboxNetwork | None:
        return self._nets.get(sandbox_id)

    async def detach(self, sandbox_id: str) -> None:
        """Remove the policy first (nothing more gets out), then the network."""
        self._nets.pop(sandbox_id, None)
        self._policies.pop(sandbox_id, None)
        try:
            await self.gateway.remove(sandbox_id)
        finally:
            await self.manager.destroy(sandbox_id)
