"""The egress gateway: per-sandbox DNS and TCP policy, TLS termination, credential injection."""

from space.gateway.client import GatewayClient, GatewayError
from space.gateway.policy import CidrRule, HostRule, Policy, SandboxPolicy, Secret
from space.gateway.process import GatewayProcess, GatewaySettings

__all__ = [
    "CidrRule",
    "GatewayClient",
    "GatewayError",
    "GatewayProcess",
    "GatewaySettings",
    "HostRule",
    "Policy",
    "SandboxPolicy",
    "Secret",
]
