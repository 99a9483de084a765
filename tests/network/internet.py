"""The test "internet": one process, run inside its own namespace, serving a DNS zone, HTTP and
HTTPS origins, a TCP echo (port 22) and a UDP echo (port 7). It logs what reaches it as JSON
lines, so tests can assert what did and did not get out. Under /git/ every origin is a private
git host: git's smart HTTP (`git http-backend`) over the bare repositories in the config's
"git_root", for the user "git" with the secret "git" as password.

On its "lenient_ports" (HTTP and HTTPS) every origin is *lenient*, as careless servers are: a
bare CR or LF ends a line, a folded line is a header of its own, the first Content-Length wins
and beats Transfer-Encoding, and connections stay open for more requests. Each request it reads
is logged: a head that a gateway and this origin split differently shows up as a second one.

    python internet.py CONFIG.json     (CONFIG: zone, cert/key paths, secrets, log path)
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import os
import re
import ssl
import sys
import zlib
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
        self.git_root: str = config["git_root"]
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
    elif "chunked" in headers.get("transfer-encoding", "").lower():
        try:
            body = await _chunked(reader)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            writer.close()
            return
    local = writer.get_extra_info("sockname")[0]
    is_git = path.startswith("/git/")
    # A git push's pack is logged by its size only (megabytes of escaped binary otherwise).
    logged = f"<{len(body)} bytes>" if is_git else body.decode("latin-1")
    world.record(kind=scheme, served_by=local, method=method, path=path, headers=headers,
                 body=logged)  # fmt: skip
    if is_git:
        await git(world, writer, method, path.removeprefix("/git"), headers, body)
        return
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
        elif path.startswith("/echo-"):  # worse: it echoes them in every way HTTP allows
            echoed = f"{headers.get('authorization')} {headers.get('x-api-key')}"
            await hostile_echo(writer, path.removeprefix("/echo-"), headers, echoed.encode())
            return
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


async def _chunked(reader: asyncio.StreamReader) -> bytes:
    """A chunked body, whole (git sends one past its 1 MiB post buffer)."""
    chunks = []
    while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
        chunks.append(await reader.readexactly(size))
        await reader.readexactly(2)
    while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers
        pass
    return b"".join(chunks)


async def git(
    world: World, writer: asyncio.StreamWriter, method: str, path: str,
    headers: dict[str, str], body: bytes,
) -> None:  # fmt: skip
    """One request of git's smart HTTP, answered by `git http-backend` (a CGI program)."""
    expected = base64.b64encode(f"git:{world.secrets['git']}".encode()).decode()
    if headers.get("authorization") != f"Basic {expected}":
        writer.write(b'HTTP/1.1 401 Unauthorized\r\nWWW-Authenticate: Basic realm="git"\r\n'
                     b"Content-Length: 0\r\nConnection: close\r\n\r\n")  # fmt: skip
        await writer.drain()
        writer.close()
        return
    path_info, _, query = path.partition("?")
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GIT_PROJECT_ROOT": world.git_root,
        "GIT_HTTP_EXPORT_ALL": "1", "REMOTE_USER": "git", "REMOTE_ADDR": "198.51.100.1",
        "REQUEST_METHOD": method, "PATH_INFO": path_info, "QUERY_STRING": query,
        "CONTENT_TYPE": headers.get("content-type", ""), "CONTENT_LENGTH": str(len(body)),
        "HTTP_CONTENT_ENCODING": headers.get("content-encoding", ""),
        "GIT_PROTOCOL": headers.get("git-protocol", ""),
    }  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        "git", "http-backend", env=env, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        out, _ = await asyncio.wait_for(proc.communicate(body), 60)
    except TimeoutError:
        proc.kill()
        out = b""
    head, _, content = out.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n") if head else []
    fields = {ln.split(":", 1)[0].strip().lower(): ln for ln in lines if ":" in ln}
    status = fields.pop("status", "Status: 200 OK").split(":", 1)[1].strip()
    fields.pop("content-length", None)  # ours below counts what is sent
    if proc.returncode != 0 and not fields:  # it failed before it answered
        status, content = "500 Internal Server Error", b""
    rest = "".join(f"{ln}\r\n" for ln in fields.values())
    writer.write(f"HTTP/1.1 {status}\r\n{rest}Content-Length: {len(content)}\r\n"
                 "Connection: close\r\n\r\n".encode() + content)  # fmt: skip
    await writer.drain()
    writer.close()


async def hostile_echo(
    writer: asyncio.StreamWriter, how: str, headers: dict[str, str], text: bytes
) -> None:
    """The credentials sent back so that a byte-exact search cannot find them: split across
    chunks, gzip- or deflate-encoded (when asked for, or always), in the ranges asked for,
    with a transfer coding, or with an encoding nobody can search."""
    accept = headers.get("accept-encoding", "") + headers.get("te", "")
    head = "HTTP/1.1 {status}\r\nConnection: close\r\n{extra}"
    status, extra, body = "200 OK", "", text
    if how == "chunked":  # each chunk a few bytes: every value straddles boundaries
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(text[i : i + 5]), text[i : i + 5])
                          for i in range(0, len(text), 5))  # fmt: skip
        writer.write(
            head.format(status=status, extra="Transfer-Encoding: chunked\r\n\r\n").encode()
        )
        for i in range(0, len(chunks), 7):
            writer.write(chunks[i : i + 7])
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()
        return
    if (how == "gzip" and "gzip" in accept) or how == "gzip-always":
        extra, body = "Content-Encoding: gzip\r\n", gzip.compress(text)
    elif how == "gzip-members":  # a harmless first member, the credentials in the second
        extra, body = "Content-Encoding: gzip\r\n", gzip.compress(b"-") + gzip.compress(text)
    elif how == "deflate-always":
        extra, body = "Content-Encoding: deflate\r\n", zlib.compress(text)
    elif how == "br-always":
        extra = "Content-Encoding: br\r\n"
    elif (how == "te" and "gzip" in accept) or how == "te-always":
        body = gzip.compress(text)
        body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        extra = "Transfer-Encoding: gzip, chunked\r\n"
    elif how == "range" and (spec := headers.get("range", "")).startswith("bytes="):
        first, _, last = spec.removeprefix("bytes=").partition("-")
        start, end = int(first), int(last) if last else len(text) - 1
        status, body = "206 Partial Content", text[start : end + 1]
        extra = f"Content-Range: bytes {start}-{end}/{len(text)}\r\n"
    elif how == "range-always":  # its first half, asked for or not
        status, body = "206 Partial Content", text[: len(text) // 2]
        extra = f"Content-Range: bytes 0-{len(body) - 1}/{len(text)}\r\n"
    if "Transfer-Encoding" not in extra:
        extra += f"Content-Length: {len(body)}\r\n"
    writer.write(head.format(status=status, extra=extra + "\r\n").encode() + body)
    await writer.drain()
    writer.close()


LENIENT_LINE = re.compile(r"\r\n|\n|\r")
LENIENT_END = re.compile(rb"(?:\r\n|\n|\r(?!\n))(?:\r\n|\n|\r(?!\n))")


async def lenient(
    world: World, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, scheme: str
) -> None:
    buffer = b""
    try:
        while True:
            while (end := LENIENT_END.search(buffer)) is None:
                if not (data := await reader.read(65536)):
                    return
                buffer += data
            head, buffer = buffer[: end.start()], buffer[end.end() :]
            lines = LENIENT_LINE.split(head.decode("latin-1"))
            method, path = ([*lines[0].split(" "), "", ""])[:2]
            headers: dict[str, str] = {}
            for line in lines[1:]:
                key, _, value = line.strip().partition(":")
                headers.setdefault(key.strip().lower(), value.strip())
            length = int(headers.get("content-length", "0") or 0)
            while len(buffer) < length:
                if not (data := await reader.read(65536)):
                    return
                buffer += data
            body, buffer = buffer[:length], buffer[length:]
            world.record(kind="lenient", scheme=scheme, method=method, path=path,
                         headers=headers, body=body.decode("latin-1"))  # fmt: skip
            text = f"lenient: {path}".encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(text), text))
            await writer.drain()
    except (ConnectionError, ssl.SSLError, ValueError):
        pass
    finally:
        writer.close()


async def echo(world: World, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    peer = ":".join(map(str, writer.get_extra_info("peername")))
    world.record(kind="tcp-echo", served_by=writer.get_extra_info("sockname")[0], peer=peer)
    try:
        while data := await reader.read(4096):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    world.record(kind="tcp-echo-closed", peer=peer)  # the gateway let go of it
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
    ports = config["lenient_ports"]
    await asyncio.start_server(lambda r, w: lenient(world, r, w, "http"), "0.0.0.0", ports["http"])
    await asyncio.start_server(
        lambda r, w: lenient(world, r, w, "https"), "0.0.0.0", ports["https"], ssl=tls
    )
    await asyncio.start_server(lambda r, w: echo(world, r, w), "0.0.0.0", 22)
    Path(config["ready"]).write_text("ready")
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
