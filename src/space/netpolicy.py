"""A sandbox's egress as the API takes it (a policy and secret bindings, no secret values) and
as its worker's gateway gets it (the same policy, the bound secrets' values filled in).

A binding names one of the tenant's secrets, the hosts it may be sent to, and how: a header the
gateway adds, and/or an environment variable in which the guest finds a placeholder
(`space-secret-…`) that the gateway swaps for the value on requests to those hosts only.
"""

from __future__ import annotations

import re
import secrets
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from space.db.sealing import Sealer
from space.db.store import Row, Store
from space.gateway.policy import CidrRule, HostRule, Policy, Secret

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
HEADER_NAME = re.compile(r"^[A-Za-z0-9-]{1,64}$")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NetworkPolicy(Strict):
    default: Literal["deny", "allow"] = Field(
        "deny", description="deny: only what `hosts` and `cidrs` allow; allow: any public name"
    )
    hosts: list[HostRule] = Field(default_factory=list, max_length=256)
    cidrs: list[CidrRule] = Field(default_factory=list, max_length=256)
    allow_networks: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="private networks names may resolve to, among those the operator opened",
    )

    def gateway(self) -> Policy:
        """The same policy as the gateway takes it, with no secrets."""
        return Policy(default=self.default, hosts=self.hosts, cidrs=self.cidrs,
                      allow_networks=self.allow_networks)  # fmt: skip


class SecretBinding(Strict):
    secret: str = Field(min_length=1, max_length=128, description="the name of your secret")
    hosts: list[str] = Field(min_length=1, max_length=64, description="name or *.name patterns")
    header: str | None = Field(None, description="a header the gateway adds on those hosts")
    header_value: str = Field("{value}", max_length=1024, description="e.g. 'Bearer {value}'")
    env: str | None = Field(None, description="a variable holding the guest's placeholder")
    placeholder: str | None = Field(None, description="set by SPACE; do not send")

    @field_validator("hosts")
    @classmethod
    def patterns(cls, hosts: list[str]) -> list[str]:
        return [HostRule(pattern=h).pattern for h in hosts]

    @model_validator(mode="after")
    def one_way(self) -> SecretBinding:
        if self.header is None and self.env is None:
            raise ValueError("give `header` (added by the gateway), `env` (a placeholder), or both")
        if self.header is not None and not HEADER_NAME.match(self.header):
            raise ValueError(f"{self.header!r} is not a header name")
        if self.env is not None and not ENV_NAME.match(self.env):
            raise ValueError(f"{self.env!r} is not a variable name")
        if "{value}" not in self.header_value:
            raise ValueError("header_value must contain {value}")
        return self


def with_placeholders(bindings: list[SecretBinding]) -> list[dict[str, Any]]:
    """The bindings as stored: each one with an env variable gets a fresh placeholder."""
    out = []
    for b in bindings:
        placeholder = f"space-secret-{secrets.token_hex(16)}" if b.env else None
        out.append(b.model_copy(update={"placeholder": placeholder}).model_dump())
    return out


def placeholder_env(bindings: list[dict[str, Any]]) -> dict[str, str]:
    """What the guest's environment holds instead of the secrets."""
    return {b["env"]: b["placeholder"] for b in bindings if b.get("env")}


Default = Literal["deny", "allow"]  # a deployment's for sandboxes without a policy (Settings)


def gateway_policy(
    network: dict[str, Any] | None,
    bindings: list[dict[str, Any]],
    values: dict[str, str],
    default: Default,
) -> Policy:
    """The policy the gateway enforces for a sandbox: its own (or `default`: all of the public
    internet, or nothing), with the values of its bound secrets."""
    base = NetworkPolicy.model_validate(network or {"default": default})
    return base.gateway().model_copy(
        update={"secrets": [_secret(b, values[b["secret"]]) for b in bindings]}
    )


async def policy_for(
    store: Store, sealer: Sealer, row: Row, default: Default,
    network: dict[str, Any] | None = None,
) -> Policy:  # fmt: skip
    """The gateway policy of a sandbox row (with `network` instead of its own, if given);
    Refused or SealError when a bound secret is gone or does not open."""
    bindings = row["secrets"]
    names = sorted({b["secret"] for b in bindings})
    values = await store.open_secrets(row["tenant_id"], names, sealer)
    own = network if network is not None else row["network"]
    return gateway_policy(own, bindings, values, default)


def _secret(binding: dict[str, Any], value: str) -> Secret:
    return Secret(
        name=binding["secret"],
        value=value,
        hosts=binding["hosts"],
        header=binding.get("header"),
        header_value=binding.get("header_value") or "{value}",
        placeholder=binding.get("placeholder"),
    )
