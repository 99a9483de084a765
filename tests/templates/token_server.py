"""A token service for a registry with `auth: token` (Docker's token protocol), for the tests.

It checks Basic credentials and answers a JWT (RS256, its certificate in the `x5c` header) that
grants the scope asked for; the registry verifies it against the certificate it is given as its
root bundle. This is the flow of Docker Hub, GHCR and most hosted registries.
"""

from __future__ import annotations

import base64
import datetime
import json
import secrets
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.x509.oid import NameOID

ISSUER = "space-test-issuer"
SERVICE = "space-test-registry"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class TokenService:
    def __init__(self, tmp: Path, user: str, password: str) -> None:
        self.user, self.password = user, password
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "space-test-token")])
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .sign(self.key, hashes.SHA256())
        )
        self.bundle = tmp / "token-cert.pem"
        self.bundle.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))
        self.tokens_issued = 0
        service = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                query = parse_qs(urlparse(self.path).query)
                auth = self.headers.get("Authorization", "")
                given = base64.b64decode(auth[6:]).decode() if auth.startswith("Basic ") else ""
                if given != f"{service.user}:{service.password}":
                    self.send_response(401)
                    self.end_headers()
                    return
                token = service.token(query.get("scope", [""])[0])
                body = json.dumps({"token": token}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.realm = f"http://127.0.0.1:{self.server.server_address[1]}/token"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def token(self, scope: str) -> str:
        """A JWT granting `scope` ("repository:NAME:pull,push")."""
        access = []
        if scope:
            kind, name, actions = scope.split(":")
            access.append({"type": kind, "name": name, "actions": actions.split(",")})
        der = self.cert.public_bytes(serialization.Encoding.DER)
        header = {"typ": "JWT", "alg": "RS256", "x5c": [base64.b64encode(der).decode()]}
        now = int(time.time())
        claims = {
            "iss": ISSUER,
            "sub": self.user,
            "aud": SERVICE,
            "exp": now + 300,
            "nbf": now - 10,
            "iat": now,
            "jti": secrets.token_hex(8),
            "access": access,
        }
        signing = f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(claims).encode())}"
        sig = self.key.sign(signing.encode(), padding.PKCS1v15(), hashes.SHA256())
        self.tokens_issued += 1
        return f"{signing}.{_b64(sig)}"

    def registry_auth(self) -> str:
        """The `auth:` section of the registry's config.yml."""
        return (
            "auth:\n  token:\n"
            f"    realm: {self.realm}\n    service: {SERVICE}\n    issuer: {ISSUER}\n"
            f"    rootcertbundle: {self.bundle}\n"
        )

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
