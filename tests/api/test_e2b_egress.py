"""E2B's egress switches as SPACE policies, whatever the deployment's default: one who says no
to the internet gets no (a deployment whose default is allow must not turn it into yes)."""

from __future__ import annotations

import pytest

from space.api.errors import APIError
from space.e2b.rest import NetworkChange, NetworkConfig, egress


def change(**body: object) -> NetworkChange:
    return NetworkChange.model_validate(body)


def test_a_no_is_a_deny_policy_not_the_default() -> None:
    for body in ({"allow_internet_access": False}, {"denyOut": ["0.0.0.0/0"]}):
        policy = egress(change(**body), change(**body).allow_internet_access)
        assert policy is not None and policy.default == "deny" and not policy.hosts, body
    # Saying nothing leaves the deployment's default (the caller applies it).
    assert egress(None, None) is None
    assert egress(change(), None) is None


def test_all_traffic_and_lists() -> None:
    everything = egress(NetworkConfig.model_validate({"allowOut": ["0.0.0.0/0"]}), None)
    assert everything is not None and everything.default == "allow"
    internet = egress(None, True)
    assert internet is not None and internet.default == "allow"
    listed = egress(NetworkConfig.model_validate({"allowOut": ["a.test", "10.1.0.0/16"]}), True)
    assert listed is not None and listed.default == "deny"
    assert [h.pattern for h in listed.hosts] == ["a.test"]
    assert [c.cidr for c in listed.cidrs] == ["10.1.0.0/16"]
    # IPv6's "everywhere" is no list of IPv4: not all traffic.
    v6 = egress(NetworkConfig.model_validate({"allowOut": ["::/0"]}), None)
    assert v6 is not None and v6.default == "deny"


def test_what_is_refused() -> None:
    with pytest.raises(APIError, match="denyOut takes only"):
        egress(NetworkConfig.model_validate({"denyOut": ["10.0.0.0/8"]}), None)
    with pytest.raises(APIError):
        egress(NetworkConfig.model_validate({"allowOut": ["not a host!"]}), None)
