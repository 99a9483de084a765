"""`python -m space.gateway`: the gateway process (run one per worker, as root)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import os
import pwd
import signal
import socket
import sys
from pathlib import Path

import uvicorn

from space.gateway import audit, limits
from space.gateway.control import make_app
from space.gateway.policy import EgressFloor
from space.gateway.server import Gateway, GatewayConfig

PR_SET_PDEATHSIG = 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="space-gateway", description=__doc__)
    p.add_argument("--state-dir", type=Path, default=Path("/var/lib/space/gateway"))
    p.add_argument("--control-socket", type=Path, default=Path("/run/space/gateway.sock"))
    p.add_argument("--upstream-dns", required=True, help="resolver the gateway asks, HOST[:PORT]")
    p.add_argument("--upstream-ca", type=Path, default=None, help="CA bundle for upstream TLS")
    p.add_argument("--ca-dir", type=Path, default=None, help="the CA to sign with (ca.pem, ca.key)")
    p.add_argument("--listen", default="0.0.0.0")
    p.add_argument("--proxy-port", type=int, default=15001)
    p.add_argument("--dns-port", type=int, default=15053)
    p.add_argument("--max-connections", type=int, default=512, help="per sandbox")
    p.add_argument(
        "--open-network",
        action="append",
        default=[],
        help="a private network sandbox policies may reach (repeat)",
    )
    p.add_argument(
        "--closed-network",
        action="append",
        default=[],
        help="never dialled, even inside an open network: sandbox ranges (repeat)",
    )
    p.add_argument("--max-total-connections", type=int, default=8192, help="all sandboxes")
    p.add_argument("--head-timeout", type=float, default=10.0, help="seconds for a request head")
    p.add_argument("--idle-timeout", type=float, default=60.0, help="seconds with nothing moving")
    p.add_argument("--dns-rate", type=float, default=100.0, help="queries/s per sandbox")
    p.add_argument("--dns-burst", type=int, default=200, help="queries at once per sandbox")
    p.add_argument("--audit-ring", type=int, default=1000, help="events in memory per sandbox")
    p.add_argument("--audit-rings", type=int, default=256, help="sandboxes kept in memory")
    p.add_argument("--audit-file-bytes", type=int, default=64 << 20, help="rotated past this")
    p.add_argument("--audit-files", type=int, default=5, help="rotated files kept")
    p.add_argument("--user", help="run as this user once the ports, CA and files are open")
    p.add_argument("--die-with", type=int, help="end when this process (the parent) ends")
    return p.parse_args(argv)


async def run(args: argparse.Namespace) -> None:
    host, _, port = args.upstream_dns.partition(":")
    total = descriptors_for(args.max_total_connections)
    gateway = Gateway(
        GatewayConfig(
            state_dir=args.state_dir,
            upstream_dns=host,
            upstream_dns_port=int(port or 53),
            listen_host=args.listen,
            proxy_port=args.proxy_port,
            dns_port=args.dns_port,
            upstream_ca_file=args.upstream_ca,
            ca_dir=args.ca_dir,
            max_connections=min(args.max_connections, total // 2),
            max_total_connections=total,
            head_timeout=args.head_timeout,
            idle_timeout=args.idle_timeout,
            dns_rate=args.dns_rate,
            dns_burst=args.dns_burst,
            audit=audit.Limits(
                args.audit_ring, args.audit_rings, args.audit_file_bytes, args.audit_files
            ),
            floor=EgressFloor(open_networks=args.open_network, closed_networks=args.closed_network),
        )
    )
    await gateway.start()
    control = bind_control(args.control_socket)
    if args.user:
        # It writes leaf certificates for a moment, and rotates the audit files.
        drop_privileges(args.user, [gateway.ca.leaf_dir, gateway.audit.directory])
    if args.die_with:
        die_with(args.die_with)  # after dropping root: a change of user clears the setting
    server = uvicorn.Server(uvicorn.Config(make_app(gateway), log_level="warning", lifespan="off"))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    serving = asyncio.create_task(server.serve(sockets=[control]))
    await stop.wait()
    server.should_exit = True
    await serving
    await gateway.close()


def descriptors_for(total: int) -> int:
    """Raise RLIMIT_NOFILE (while still root) to what `total` connections need; the total that
    fits if it cannot be raised that far."""
    got = limits.raise_nofile(limits.fds_needed(total))
    if got < limits.fds_needed(total):
        fits = max(2, (got - limits.RESERVED_FDS) // 2)
        print(f"space-gateway: {got} file descriptors allow {fits} connections, not {total}",
              file=sys.stderr)  # fmt: skip
        return min(total, fits)
    return total


def bind_control(path: Path) -> socket.socket:
    """The control socket, made by root with mode 0600 before any privilege is dropped: only
    root (the worker) can talk to the gateway."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    sock.listen(64)
    return sock


def die_with(pid: int) -> None:
    """End (SIGTERM) when our parent `pid` ends, however it ends: a gateway whose worker is
    gone serves nobody, and a worker starting again runs its own."""
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != pid:
        raise OSError(f"the process that started the gateway ({pid}) is gone")


def drop_privileges(user: str, writable: list[Path]) -> None:
    """Become `user`: everything that needs root (ports, CA key, audit file) is open by now.
    The directories in `writable` are handed to it."""
    entry = pwd.getpwnam(user)
    for directory in writable:
        os.chown(directory, entry.pw_uid, entry.pw_gid)
    os.setgroups([])
    os.setgid(entry.pw_gid)
    os.setuid(entry.pw_uid)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        asyncio.run(run(args))
    except (OSError, KeyError) as e:  # KeyError: no such --user
        print(f"space-gateway: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
