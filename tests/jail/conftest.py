"""The jail tests boot real VMs, as tests/vm does."""

from tests.vm.conftest import runtime  # noqa: F401
