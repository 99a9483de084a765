"""A small world of real namespaces for the gateway tests and the benchmark.

    internet (netns spt-inet): DNS 198.51.100.53, origins 198.51.100.10-12 (HTTP, HTTPS with a test
        CA), a "private" origin 10.66.0.10, a stand-in metadata service on 169.254.169.254 and
        TCP/UDP echo services; routed from the host.
    gateway: `python -m space.gateway` as a real process in the host namespace.
    sandboxes: NetworkManager networks; the guest side of each is a veth whose peer `eth0` sits in
        a "guest" namespace configured exactly as a VM's eth0 is (address, MAC, routes). A tap
        needs a VM or a userspace program on its other end; the veth gives the same L2 link.

Everything is named with the `spt` prefix and removed by `stop()`, and by `start()` if a
crashed run left it behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import fcntl
import ipaddress
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from space.gateway import GatewayClient, GatewayProcess, GatewaySettings, Policy
from space.gateway.tls import make_ca
from space.worker.network import Egress, NetworkConfig, NetworkManager, SandboxNetwork
from space.worker.network import netns as nsutil

HERE = Path(__file__).parent
INET_NS = "spt-inet"
INET_LINK = "sptinet0"
HOST_IP = "198.51.100.1"
DNS_IP = "198.51.100.53"
ORIGINS = {"allowed.test": "198.51.100.10", "secret.test": "198.51.100.11",
           "inspect.test": "198.51.100.12", "other.test": "198.51.100.13",
           "evil.test": "198.51.100.14"}  # fmt: skip
LENIENT_PORTS = {"http": 8080, "https": 8443}  # every origin, parsing as carelessly as it can
PRIVATE_ORIGIN = "10.66.0.10"
OPEN_NETWORK = "10.66.0.0/24"  # the one private network the world's operator opens
# A stand-in for the cloud metadata service, on its real address inside the internet namespace:
# no policy may reach it (the host routes it there only while a world runs).
METADATA_IP = "169.254.169.254"
ZONE = {**ORIGINS, "rebind.test": PRIVATE_ORIGIN, "rebind-local.test": "127.0.0.1",
        "metadata.test": "169.254.169.254"}  # fmt: skip
NET_CONFIG = NetworkConfig(
    host_range="10.201.0.0/16",
    link_prefix="spt-",
    netns_prefix="spt-sb-",
    table="space_test",
    proxy_port=25001,
    dns_port=25053,
)
GATEWAY_USER = "nobody"  # the gateway serves every test unprivileged
# Limits low enough for a test to reach them (a red-team client gives up after 2 s: heads
# time out later than that).
MAX_CONNECTIONS = 64  # per sandbox
MAX_TOTAL_CONNECTIONS = 128
HEAD_TIMEOUT = 4.0
IDLE_TIMEOUT = 8.0
DNS_RATE, DNS_BURST = 50.0, 100
AUDIT_RING, AUDIT_RINGS = 500, 16  # events per sandbox, sandboxes
AUDIT_FILE_BYTES, AUDIT_FILES = 64 << 10, 3
TEST_LIMITS: dict[str, Any] = {
    "max_connections": MAX_CONNECTIONS, "max_total_connections": MAX_TOTAL_CONNECTIONS,
    "head_timeout": HEAD_TIMEOUT, "idle_timeout": IDLE_TIMEOUT, "dns_rate": DNS_RATE,
    "dns_burst": DNS_BURST, "audit_ring": AUDIT_RING, "audit_rings": AUDIT_RINGS,
    "audit_file_bytes": AUDIT_FILE_BYTES, "audit_files": AUDIT_FILES,
}  # fmt: skip
BEARER = "real-bearer-" + secrets.token_hex(8)
HEADER_SECRET = "real-header-" + secrets.token_hex(8)
GIT_PASSWORD = "git-" + secrets.token_hex(8)  # the user "git"'s at the origins' /git/


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {proc.stderr.strip()}")
    return proc


def _origin_cert(directory: Path) -> tuple[Path, Path, Path]:
    """A test CA and one leaf for every origin name (the origins' "public" PKI)."""
    ca_cert, ca_key = directory / "origin-ca.pem", directory / "origin-ca.key"
    make_ca(ca_cert, ca_key, "SPACE test origins CA")
    ca = x509.load_pem_x509_certificate(ca_cert.read_bytes())
    signer = serialization.load_pem_private_key(ca_key.read_bytes(), None)
    assert isinstance(signer, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "origins")]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in ZONE]), critical=False)
        .sign(signer, hashes.SHA256())
    )
    cert_path, key_path = directory / "origin.pem", directory / "origin.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return ca_cert, cert_path, key_path


@dataclass
class Guest:
    name: str  # the sandbox id
    netns: str  # the "guest" namespace, where attacks run
    net: SandboxNetwork


@dataclass
class World:
    directory: Path
    manager: NetworkManager = field(default_factory=lambda: NetworkManager(NET_CONFIG))
    guests: dict[str, Guest] = field(default_factory=dict)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    origin_ca: Path | None = None
    gateway: GatewayProcess | None = None
    egress: Egress | None = None  # the worker's handle: networks + policies
    # The gateway's limits ({}: its production defaults).
    limits: dict[str, Any] = field(default_factory=lambda: dict(TEST_LIMITS))

    @property
    def control_socket(self) -> Path:
        return self.directory / "gateway.sock"

    @property
    def internet_log(self) -> Path:
        return self.directory / "internet.jsonl"

    @property
    def git_root(self) -> Path:
        """The origins' git repositories (bare), served under https://ORIGIN/git/."""
        return self.directory / "git"

    @property
    def gateway_ca(self) -> Path:
        return self.directory / "gateway" / "ca" / "ca.pem"

    def client(self) -> GatewayClient:
        return GatewayClient(self.control_socket)

    async def start(self) -> None:
        cleanup()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._internet()
        await self.start_gateway()
        assert self.egress is not None
        await self.egress.start({})

    async def start_gateway(self) -> Egress:
        """(Re)start the gateway process as a worker does; a new Egress talks to it."""
        if self.egress is not None:
            await self.egress.gateway.close()
        assert self.origin_ca is not None
        self.gateway = GatewayProcess(
            GatewaySettings(
                state_dir=self.directory / "gateway",
                control_socket=self.control_socket,
                upstream_dns=DNS_IP,
                upstream_ca=self.origin_ca,
                proxy_port=NET_CONFIG.proxy_port,
                dns_port=NET_CONFIG.dns_port,
                user=GATEWAY_USER,
                open_networks=(OPEN_NETWORK,),
                closed_networks=(NET_CONFIG.host_range,),
                **self.limits,
            )
        )
        client = await self.gateway.start()
        self.egress = Egress(self.manager, client)
        return self.egress

    def _internet(self) -> None:
        _lock()
        _check_unrouted()
        nsutil.create(INET_NS, lambda: None)
        sh("ip", "link", "add", INET_LINK, "type", "veth", "peer", "name", "eth0",
           "netns", INET_NS)  # fmt: skip
        sh("ip", "addr", "add", f"{HOST_IP}/24", "dev", INET_LINK)
        sh("ip", "link", "set", INET_LINK, "up")
        sh("ip", "route", "add", OPEN_NETWORK, "via", "198.51.100.2")
        sh("ip", "route", "add", f"{METADATA_IP}/32", "via", "198.51.100.2")
        n = ["ip", "-n", INET_NS]
        sh(*n, "addr", "add", "198.51.100.2/24", "dev", "eth0")
        for address in [DNS_IP, *ORIGINS.values()]:
            sh(*n, "addr", "add", f"{address}/24", "dev", "eth0")
        sh(*n, "addr", "add", f"{PRIVATE_ORIGIN}/32", "dev", "lo")
        sh(*n, "addr", "add", f"{METADATA_IP}/32", "dev", "lo")
        sh(*n, "link", "set", "eth0", "up")
        sh(*n, "link", "set", "lo", "up")
        sh(*n, "route", "add", "default", "via", HOST_IP)
        self.origin_ca, cert, key = _origin_cert(self.directory)
        ready = self.directory / "internet.ready"
        self.git_root.mkdir(exist_ok=True)
        config = {"zone": ZONE, "git_root": str(self.git_root),
                  "secrets": {"bearer": BEARER, "header": HEADER_SECRET, "git": GIT_PASSWORD},
                  "log": str(self.internet_log), "cert": str(cert), "key": str(key),
                  "dns_ip": DNS_IP, "ready": str(ready),
                  "lenient_ports": LENIENT_PORTS}  # fmt: skip
        (self.directory / "internet.json").write_text(json.dumps(config))
        self._spawn(
            ["ip", "netns", "exec", INET_NS, sys.executable, str(HERE / "internet.py"),
             str(self.directory / "internet.json")], "internet.log", ready,
        )  # fmt: skip

    def _spawn(self, argv: list[str], log: str, ready: Path) -> None:
        with (self.directory / log).open("ab") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=out, start_new_session=True)
        self.procs.append(proc)
        deadline = time.monotonic() + 20
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                text = (self.directory / log).read_text(errors="replace")
                raise RuntimeError(f"{argv[2:4]} did not start: {text[-2000:]}")
            time.sleep(0.02)

    async def add_guest(self, sandbox_id: str, policy: Policy) -> Guest:
        guest_ns = f"spt-guest-{sandbox_id}"
        nsutil.create(guest_ns, lambda: None)
        net = await self.manager.create(sandbox_id, guest_veth_netns=guest_ns)
        n = ["ip", "-n", guest_ns]
        sh(*n, "link", "set", "lo", "up")
        sh(*n, "link", "set", "eth0", "address", net.guest_mac)  # QEMU's -device mac=
        etc = Path("/etc/netns") / guest_ns  # `ip netns exec` mounts its files over /etc's
        etc.mkdir(parents=True, exist_ok=True)
        # The guest agent's own boot-time configuration, run in the "guest".
        configure = (
            "import sys; from pathlib import Path; from space.guest.system import "
            "configure_network as c; sys.exit(0 if c('eth0', Path(sys.argv[1])) else 1)"
        )
        sh("ip", "netns", "exec", guest_ns, sys.executable, "-c", configure,
           str(etc / "resolv.conf"))  # fmt: skip
        # A guest's root can add IPv6 itself; give it a route so attempts leave the guest.
        sh(*n, "addr", "add", "fd00:5ace::2/64", "dev", "eth0", "nodad")
        sh(*n, "-6", "route", "add", "default", "via", "fd00:5ace::1")
        assert self.egress is not None
        assert await self.egress.attach(sandbox_id, policy) == net  # adopts what was made
        guest = Guest(sandbox_id, guest_ns, net)
        self.guests[sandbox_id] = guest
        return guest

    def run_in_guest(
        self, guest: Guest, argv: list[str], env: dict[str, str] | None = None, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["ip", "netns", "exec", guest.netns, *argv],
            capture_output=True, text=True, timeout=timeout, check=False,
            env={**os.environ, **(env or {})},
        )  # fmt: skip

    async def spawn_in_guest(self, guest: Guest, argv: list[str]) -> asyncio.subprocess.Process:
        """A process in `guest`, its stdin and stdout piped, running while the test goes on."""
        return await asyncio.create_subprocess_exec(
            "ip", "netns", "exec", guest.netns, *argv, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip

    def internet_events(self) -> list[dict[str, object]]:
        if not self.internet_log.exists():
            return []
        return [json.loads(line) for line in self.internet_log.read_text().splitlines() if line]

    async def stop(self) -> None:
        try:
            if self.egress is not None:
                for guest in self.guests.values():
                    with contextlib.suppress(Exception):
                        await self.egress.detach(guest.name)
                await self.egress.gateway.close()
            if self.gateway is not None:
                await self.gateway.stop()
            for proc in self.procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
            for proc in self.procs:
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            for guest in self.guests.values():
                await self.manager.destroy(guest.name)
            await self.manager.sweep()
            await self.manager.stop()
        finally:
            cleanup()
            _unlock()


# A world owns host-wide names and routes (198.51.100.0/24, 10.66.0.0/24, 169.254.169.254,
# `spt-*`): two at once on one host would tear each other down, so each process holds this lock
# from its first clean-up or world until its world stops; another run waits.
LOCK = Path("/run/space-test-network-world.lock")
_lock_fd: int | None = None


def _lock() -> None:
    global _lock_fd
    if _lock_fd is None:
        fd = os.open(LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        _lock_fd = fd


def _unlock() -> None:
    global _lock_fd
    if _lock_fd is not None:
        os.close(_lock_fd)  # releases the flock
        _lock_fd = None


def _check_unrouted() -> None:
    """The world routes its ranges into a namespace; over a range this host already reaches some
    other way (a proxy, a registry), it would cut the host off until the world stops."""
    for network in (f"{HOST_IP}/24", OPEN_NETWORK, f"{METADATA_IP}/32"):
        routes = sh("ip", "-4", "route", "show", "match", network).stdout.splitlines()
        taken = [line for line in routes if not line.startswith("default")]
        if taken:
            raise RuntimeError(f"the test world's {network} is routed on this host: {taken}")


def cleanup() -> None:
    """Remove every namespace, link, route and table the world makes (idempotent)."""
    _lock()
    for name in nsutil.names("spt-"):
        nsutil.remove(name)
        shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
    sh("ip", "link", "del", INET_LINK, check=False)
    sh("ip", "route", "del", OPEN_NETWORK, check=False)
    sh("ip", "route", "del", f"{METADATA_IP}/32", check=False)
    links = sh("ip", "-o", "link", "show").stdout
    for line in links.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith(NET_CONFIG.link_prefix):
            sh("ip", "link", "del", name, check=False)
    sh("nft", "delete", "table", "inet", NET_CONFIG.table, check=False)


def guest_config(
    world: World, guest: Guest, others: list[Guest], placeholder: str
) -> dict[str, object]:
    """What the attack suite running in `guest` needs to know (the same keys a VM run gets)."""
    return {
        "origins": ORIGINS,
        "private_origin": PRIVATE_ORIGIN,
        "outside_dns": DNS_IP,
        "gateway_ip": guest.net.gateway_ip,
        "host_ips": [guest.net.host_ip, HOST_IP],
        "gateway_ports": [NET_CONFIG.proxy_port, NET_CONFIG.dns_port],
        "other_sandboxes": [g.net.sandbox_ip for g in others] + [g.net.host_ip for g in others],
        "origin_ca": str(world.origin_ca),
        "gateway_ca": str(world.gateway_ca),
        "placeholder": placeholder,
        "lenient_ports": LENIENT_PORTS,
        "interface": "eth0",
        "can_spoof": True,
    }


def ip_in(address: str, network: str) -> bool:
    return ipaddress.ip_address(address) in ipaddress.ip_network(network)


async def wait_for(predicate: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if callable(predicate) and predicate():
            return
        await asyncio.sleep(0.05)
