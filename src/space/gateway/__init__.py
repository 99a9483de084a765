"""The egress gateway: per-sandbox DNS and TCP policy, TLS termination, credential injection."""

from space.gateway.client import GatewayClient, GatewayError
from space.gateway.policy import CidrRule, HostRule, Policy, SandboxPolicy, Secret

__all__ = [
    "CidrRule",
    "GatewayClient",
    "GatewayError",
    "HostRule",
    "Policy",
    "SandboxPolicy",
    "Secret",
]
