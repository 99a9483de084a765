"""This release's version, and which releases work together.

The rule (docs/upgrading.md): releases are numbered MAJOR.MINOR.PATCH; two services work
together when their MAJOR is the same and their MINOR at most one apart, so a control plane of
release N works with workers of N-1 and N+1 and the other way round, and a rolling upgrade can
replace one service at a time. Every call between services carries its sender's version in
`HEADER`; one from a release before versions were sent (0.1) carries none. A service that meets
one outside the rule refuses it, naming both versions (HTTP 426).
"""

from __future__ import annotations

import re

VERSION = "0.2.0"
HEADER = "Space-Version"
UNVERSIONED = "0.1.0"  # what a peer that sends no version runs
_SEMVER = re.compile(r"^(\d+)\.(\d+)\.(\d+)(?:[-+][0-9A-Za-z.+-]*)?$")


def parse(version: str) -> tuple[int, int, int]:
    match = _SEMVER.match(version)
    if match is None:
        raise ValueError(f"{version!r} is not a version (MAJOR.MINOR.PATCH)")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch)


def refusal(theirs: str | None, role: str, ours: str = VERSION) -> str | None:
    """Why a `role` ("worker", "control plane") of release `theirs` cannot work with this
    release, or None when it can."""
    theirs = theirs or UNVERSIONED
    try:
        their_major, their_minor, _ = parse(theirs)
    except ValueError as e:
        return f"a {role} sent no valid release: {e}"
    our_major, our_minor, _ = parse(ours)
    if their_major == our_major and abs(their_minor - our_minor) <= 1:
        return None
    return (
        f"a {role} of release {theirs} cannot work with release {ours}: releases work together "
        "only with the same major version and at most one minor version apart; upgrade one "
        "release at a time (docs/upgrading.md)"
    )


def newer(theirs: str | None, ours: str = VERSION) -> bool:
    """Whether `theirs` is a later release than ours (it may send fields we do not know)."""
    try:
        return parse(theirs or UNVERSIONED) > parse(ours)
    except ValueError:
        return False
