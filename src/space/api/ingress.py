"""Ingress: HTTP to a port a sandbox listens on, through the API and nothing else.

Sandboxes accept no inbound connection at all (their namespace drops it); this route is the one
way in, authenticated like every call. The request travels the data plane the API already has:
the worker runs a small relay in the guest that connects to 127.0.0.1:PORT, feeds it the request
and streams the answer back. HTTP/1.0 with the whole body in one piece: for web UIs and APIs an
agent starts in its sandbox, not for bulk transfers.
"""

from __future__ import annotations

import base64
import json
from typing import Annotated

from fastapi import APIRouter, Path, Request, Response

from space.api.data import target
from space.api.deps import Caller, Svc
from space.api.errors import APIError

router = APIRouter(prefix="/v1/sandboxes/{sandbox_id}", tags=["ingress"])

MAX_BODY = 16 << 20
RELAY = """
import socket, sys, threading
try:
    s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=30)
except OSError as e:
    sys.stderr.write(f"nothing answers on port {sys.argv[1]} in the sandbox: {e.strerror}")
    sys.exit(7)
def up():
    while data := sys.stdin.buffer.read1(65536):
        s.sendall(data)
    s.shutdown(socket.SHUT_WR)
threading.Thread(target=up, daemon=True).start()
while data := s.recv(65536):
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()
"""
# Not passed on: hop-by-hop headers, and our own credentials.
DROP_IN = {"host", "authorization", "connection", "keep-alive", "transfer-encoding",
           "content-length", "te", "upgrade", "proxy-authorization"}  # fmt: skip
DROP_OUT = {"connection", "keep-alive", "transfer-encoding", "content-length"}

Port = Annotated[int, Path(ge=1, le=65535)]


async def ingress(
    sandbox_id: str, port: Port, path: str, request: Request, svc: Svc, caller: Caller
) -> Response:
    """Forward the request to 127.0.0.1:PORT inside the sandbox and answer with its response
    (502 when nothing listens there)."""
    url = await target(svc, caller.id, sandbox_id)
    body = await request.body()
    if len(body) > MAX_BODY:
        raise APIError(413, f"request bodies over {MAX_BODY >> 20} MiB are not forwarded")
    wanted = "/" + path + (f"?{request.url.query}" if request.url.query else "")
    head = [f"{request.method} {wanted} HTTP/1.0", f"Host: localhost:{port}"]
    head += [f"{k}: {v}" for k, v in request.headers.items() if k.lower() not in DROP_IN]
    if body:
        head.append(f"Content-Length: {len(body)}")
    raw = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body
    exec_body = {"argv": ["python3", "-c", RELAY, str(port)], "timeout": 60,
                 "stdin": base64.b64encode(raw).decode()}  # fmt: skip
    out, err, code = bytearray(), bytearray(), None
    async with svc.workers.stream("POST", f"{url}/exec", json=exec_body) as resp:
        async for line in resp.aiter_lines():
            if not line:
                continue
            event = json.loads(line)
            if event["type"] == "stdout":
                out += base64.b64decode(event["data"])
            elif event["type"] == "stderr":
                err += base64.b64decode(event["data"])
            elif event["type"] == "exit":
                code = event["exit_code"]
            elif event["type"] == "error":
                raise APIError(502, f"the relay in the sandbox failed: {event['message']}")
    if code == 7 or not out:
        detail = err.decode(errors="replace").strip() or f"no answer from port {port}"
        raise APIError(502, detail)
    return _response(bytes(out), request.method == "HEAD")


def _response(raw: bytes, head_only: bool) -> Response:
    head, sep, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if not sep or len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise APIError(502, "the service in the sandbox did not answer with HTTP")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name and name.strip().lower() not in DROP_OUT:
            headers[name.strip()] = value.strip()
    return Response(content=b"" if head_only else body, status_code=int(parts[1]),
                    headers=headers)  # fmt: skip


for _method in ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"):
    router.add_api_route(
        "/ports/{port}/{path:path}", ingress, methods=[_method], response_class=Response,
        operation_id=f"ingress_{_method.lower()}", summary=f"{_method} to a sandbox's port",
    )  # fmt: skip
