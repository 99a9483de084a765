"""The test "internet": one process, run inside its own namespace, serving a DNS zone, HTTP and
HTTPS origins, a TCP echo (port 22) and a UDP echo (port 7). It logs what reaches it as JSON
lines, so tests can assert what did and did not get out.

    python internet.py CONFIG.json     (CONFIG: zone, cert/key paths, secrets, log path)
"""

from __future__ import annotations

import asyncio
import json
import ssl
import sys
from pathlib import Path
from typing import Any

import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset


class World:
    def __init__(self, config: dict[str, Any]) -> None:
        self.zone: dict[str, str] = config["zone"]  # name → IPv4
        self.secrets: dict[str, str] = config["secrets"]  # expected credential values
        self.log = Path(config["log"]).open("a", buffering=1)  # noqa: SIM115 (lives as long as the process)

    def record(self, **event: Any) -> None:
        self.log.write(json.dumps(event) + "\n")


class DNSServer(asyncio.DatagramProtocol):
    def __init__(self, world: World) -> None:
        self.world = world
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        query = dns.message.from_wire(data)
        question = query.question[0]
        name = question.name.to_text().rstrip(".").lower()
        self.world.record(kind="dns", name=name, type=dns.rdatatype.to_text(question.rdtype))
        reply = dns.message.make_response(query)
        if name not in self.world.zone:
            reply.set_rcode(dns.rcode.NXDOMAIN)
        elif question.rdtype == dns.rdatatype.A:
            reply.answer.append(
                dns.rrset.from_text(question.name, 5, "IN", "A", self.world.zone[name])
            )
        assert self.transport is not None
        self.transport.sendto(reply.to_wire(), addr)


async def http(
    world: World, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, scheme: str
) -> None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        writer.close()
        return
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {
        k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)
    }
    body = b""
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    local = writer.get_extra_info("sockname")[0]
    world.record(kind=scheme, served_by=local, method=method, path=path, headers=headers,
                 body=body.decode("latin-1"))  # fmt: skip
    if path.startswith("/bytes/"):
        size = int(path.split("/")[2])
        writer.write(
            f"HTTP/1.1 200 OK\r\nContent-Length: {size}\r\nConnection: close\r\n\r\n".encode()
        )
        chunk = b"x" * 65536
        while size > 0:
            writer.write(chunk[: min(size, len(chunk))])
            size -= min(size, len(chunk))
            await writer.drain()
    else:
        if path == "/auth":
            ok = headers.get("authorization") == f"Bearer {world.secrets['bearer']}"
            text = "auth-ok" if ok else "auth-missing"
        elif path == "/echo":  # a careless API that echoes credentials back
            text = f"{headers.get('authorization')} {headers.get('x-api-key')}"
        elif path == "/header":
            text = (
                "header-ok"
                if headers.get("x-api-key") == world.secrets["header"]
                else "header-missing"
            )
        else:
            text = f"hello from {headers.get('host', '?')} served-by {local}"
        data = text.encode()
        writer.write(
            f"HTTP/1.1 200 OK\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
            + data
        )
    try:
        await writer.drain()
        writer.close()
        await writer.wait_closed()
    except (ConnectionError, ssl.SSLError):
        pass


async def echo(world: World, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    world.record(kind="tcp-echo", served_by=writer.get_extra_info("sockname")[0])
    try:
        while data := await reader.read(4096):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    writer.close()


class UDPEcho(asyncio.DatagramProtocol):
    def __init__(self, world: World) -> None:
        self.world = world

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        self.world.record(kind="udp-echo")
        self.transport.sendto(data, addr)


async def main(config_path: str) -> None:
    config = json.loads(Path(config_path).read_text())
    world = World(config)
    loop = asyncio.get_running_loop()
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(config["cert"], config["key"])
    await loop.create_datagram_endpoint(lambda: DNSServer(world), local_addr=(config["dns_ip"], 53))
    await loop.create_datagram_endpoint(lambda: UDPEcho(world), local_addr=("0.0.0.0", 7))
    await asyncio.start_server(lambda r, w: http(world, r, w, "http"), "0.0.0.0", 80)
    await asyncio.start_server(lambda r, w: http(world, r, w, "https"), "0.0.0.0", 443, ssl=tls)
    await asyncio.start_server(lambda r, w: echo(world, r, w), "0.0.0.0", 22)
    Path(config["ready"]).write_text("ready")
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
