"""Where a webhook may point: http(s) URLs whose addresses the egress floor permits.

Loopback, link-local (cloud metadata) and reserved addresses are never dialled; private ranges
only where the operator opened them to webhooks (`SPACE_WEBHOOK_OPEN_NETWORKS`: none by default;
apart from what sandboxes may reach, for webhooks are dialled from the controller). A literal
address is checked when the endpoint is registered; a name at every delivery, after it is
resolved, and the delivery then dials the address that was checked (the name goes in `Host` and
TLS's SNI), so a name that resolves elsewhere the second time reaches nothing new.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from concurrent.futures import Executor
from dataclasses import dataclass
from functools import partial
from urllib.parse import urlsplit

import httpx

from space.gateway.policy import EgressFloor
from space.networks import SANDBOX_RANGES

MAX_URL = 2048
RESOLVE_S = 5.0


class TargetRefused(ValueError):
    """The URL is not one a webhook may have, or resolves only to addresses it may not reach."""


@dataclass(frozen=True)
class Target:
    url: str  # with the checked address in place of the name
    host: str  # the name, for TLS's SNI
    netloc: str  # the name and port, for Host


def check_url(url: str, floor: EgressFloor) -> str:
    """The URL if a webhook may have it (a literal address checked against the floor now)."""
    if len(url) > MAX_URL:
        raise TargetRefused(f"a webhook URL has at most {MAX_URL} characters")
    try:
        parts = urlsplit(url)
        httpx.URL(url)  # what the sender will make of it
        if parts.hostname:
            parts.hostname.encode("idna")
    except (ValueError, httpx.InvalidURL, UnicodeError) as e:
        raise TargetRefused(f"not a URL: {e}") from None
    if parts.scheme not in ("http", "https"):
        raise TargetRefused("a webhook URL is http:// or https://")
    if not parts.hostname:
        raise TargetRefused("a webhook URL names a host")
    if parts.username is not None or parts.password is not None:
        raise TargetRefused("a webhook URL carries no user or password: sign with the secret")
    try:
        parts.port  # noqa: B018 - raises for a port that is not a number in range
    except ValueError:
        raise TargetRefused("the webhook URL's port is not a port") from None
    address = _literal(parts.hostname)
    if address is not None:
        _check(address, floor)
    return url


async def resolve(url: str, floor: EgressFloor, executor: Executor | None = None) -> Target:
    """Where to deliver: the first of the name's addresses the floor permits (`executor`
    resolves the name)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    literal = _literal(host)
    if literal is not None:
        _check(literal, floor)
        return Target(url, host, parts.netloc)
    loop = asyncio.get_running_loop()
    lookup = partial(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
    try:
        found = await asyncio.wait_for(loop.run_in_executor(executor, lookup), RESOLVE_S)
    except (OSError, TimeoutError, UnicodeError) as e:
        raise TargetRefused(f"{host} does not resolve: {e or type(e).__name__}") from None
    refusals = []
    for *_, sockaddr in found:
        address = ipaddress.ip_address(sockaddr[0])
        try:
            _check(address, floor)
        except TargetRefused as e:
            refusals.append(str(e))
            continue
        shown = f"[{address}]" if address.version == 6 else str(address)
        netloc = f"{shown}:{parts.port}" if parts.port else shown
        return Target(parts._replace(netloc=netloc).geturl(), host, parts.netloc)
    raise TargetRefused("; ".join(refusals) or f"{host} has no address")


def _literal(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _check(address: ipaddress.IPv4Address | ipaddress.IPv6Address, floor: EgressFloor) -> None:
    if floor.permits(address, private_ok=True):
        return
    if floor.never(address):
        raise TargetRefused(f"{address} is loopback, link-local or reserved: never dialled")
    raise TargetRefused(f"{address} is private and not opened by the operator")


def egress_floor(open_networks: list[str]) -> EgressFloor:
    """A floor of what may be dialled: the operator's open private networks (each for sandboxes
    or for webhooks, which have their own), and never a sandbox's own link."""
    return EgressFloor(open_networks=open_networks, closed_networks=[str(SANDBOX_RANGES)])
