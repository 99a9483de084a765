"""The deployment's egress default is read once, into Settings, and what the API and the
controller give the gateway comes from there: never from the environment behind its back."""

from __future__ import annotations

import pytest

from space.netpolicy import gateway_policy
from space.settings import Settings, SettingsError


def test_the_default_is_a_setting_and_a_bad_one_is_refused() -> None:
    assert Settings.from_env({}).egress_default == "deny"
    assert Settings.from_env({"SPACE_EGRESS_DEFAULT": "allow"}).egress_default == "allow"
    for bad in ("Allow", "yes", "open"):
        with pytest.raises(SettingsError, match="SPACE_EGRESS_DEFAULT must be one of deny, allow"):
            Settings.from_env({"SPACE_EGRESS_DEFAULT": bad})


def test_a_sandbox_without_a_policy_gets_the_settings_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SPACE_EGRESS_DEFAULT", "allow")  # what a process was started with...
    assert gateway_policy(None, [], {}, "deny").default == "deny"  # ...is not read again here
    monkeypatch.setenv("SPACE_EGRESS_DEFAULT", "deny")
    assert gateway_policy(None, [], {}, "allow").default == "allow"
    # A sandbox's own policy is its own, whatever the default.
    assert gateway_policy({"default": "deny"}, [], {}, "allow").default == "deny"
