"""Worker identity: mutual TLS between the control plane and its workers.

The deployment's worker CA (`SPACE_WORKER_CA_DIR`: ca.pem, ca.key) is held by the control plane
alone. Each worker makes its own key and trades a one-time join token for a certificate that
names it (`<id>.worker.space.internal`) and may only serve; the API and controller mint one for
themselves at start that may only be a client. A caller checks that the worker it reached is the
one it meant to call, and a worker asks every caller for a control-plane certificate: a worker's
certificate used elsewhere, by another worker or as a client, is refused, and so is none.
"""

from __future__ import annotations

import os
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from space.pki import load_ca, name, pem, sign_leaf, write_key

WORKER_DOMAIN = "worker.space.internal"  # .internal: never a public name
CONTROL_PLANE = "space control plane"
CERT_DAYS = 365
JOIN_S = 10.0
MAX_CSR = 8 << 10
# A worker's id goes into its certificate's DNS name: one DNS label or several (a node name).
_LABEL = r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"
WORKER_ID = rf"^{_LABEL}(\.{_LABEL})*$"
MAX_WORKER_ID = 200


class IdentityError(Exception):
    """A certificate that cannot be issued, or a join that did not go through."""


def worker_name(worker_id: str) -> str:
    """The name a worker's certificate carries, and callers check."""
    return f"{worker_id}.{WORKER_DOMAIN}".lower()


@dataclass(frozen=True)
class TLSFiles:
    """A worker's certificate and key, and the CA its callers' certificates must come from."""

    cert: Path
    key: Path
    ca: Path


def _context_with(ctx: ssl.SSLContext, key: ec.EllipticCurvePrivateKey, cert: bytes) -> None:
    # ssl loads a chain only from a file: it passes through a private directory for a moment.
    with tempfile.TemporaryDirectory(prefix="space-identity-") as tmp:
        path = Path(tmp) / "chain.pem"
        write_key(path, key, cert)
        ctx.load_cert_chain(path)


class WorkerCA:
    """The control plane's side: issues workers' certificates, and its own client context."""

    def __init__(self, directory: Path) -> None:
        self.cert, self._key = load_ca(directory)

    @property
    def ca_pem(self) -> bytes:
        return pem(self.cert)

    def issue(self, worker_id: str, csr_pem: bytes) -> bytes:
        """A serving certificate naming `worker_id` for the key of the request (whatever else
        the request asks for is ignored)."""
        if len(csr_pem) > MAX_CSR:
            raise IdentityError("the certificate request is too large")
        try:
            csr = x509.load_pem_x509_csr(csr_pem)
        except ValueError:
            raise IdentityError("not a PEM certificate request") from None
        key = csr.public_key()
        if not csr.is_signature_valid or not isinstance(key, ec.EllipticCurvePublicKey):
            raise IdentityError("the request must be signed by its own EC key")
        host = worker_name(worker_id)
        cert = sign_leaf(self.cert, self._key, key, host, [x509.DNSName(host)],
                         ExtendedKeyUsageOID.SERVER_AUTH, CERT_DAYS)  # fmt: skip
        return pem(cert)

    def client_context(self) -> ssl.SSLContext:
        """For calls to workers: a fresh client certificate, and trust in this CA alone."""
        key = ec.generate_private_key(ec.SECP256R1())
        cert = sign_leaf(self.cert, self._key, key.public_key(), CONTROL_PLANE, [],
                         ExtendedKeyUsageOID.CLIENT_AUTH, CERT_DAYS)  # fmt: skip
        ctx = ssl.create_default_context(cadata=self.ca_pem.decode())
        _context_with(ctx, key, pem(cert))
        return ctx


class WorkerIdentity:
    """A worker's side: its key, certificate and the worker CA in its directory, made on its
    first start from a join token and kept (the key never leaves the host)."""

    def __init__(self, directory: Path, worker_id: str) -> None:
        self.worker_id = worker_id
        self.files = TLSFiles(directory / "cert.pem", directory / "key.pem", directory / "ca.pem")

    def present(self) -> bool:
        return all(p.exists() for p in (self.files.cert, self.files.key, self.files.ca))

    def _key(self) -> ec.EllipticCurvePrivateKey:
        if not self.files.key.exists():
            self.files.key.parent.mkdir(parents=True, exist_ok=True)
            write_key(self.files.key, ec.generate_private_key(ec.SECP256R1()))
        key = serialization.load_pem_private_key(self.files.key.read_bytes(), None)
        assert isinstance(key, ec.EllipticCurvePrivateKey)
        return key

    def request(self) -> bytes:
        """A certificate request for this worker's key."""
        csr = (
            x509.CertificateSigningRequestBuilder()
            .subject_name(name(worker_name(self.worker_id)))
            .sign(self._key(), hashes.SHA256())
        )
        return csr.public_bytes(serialization.Encoding.PEM)

    def accept(self, cert_pem: bytes, ca_pem: bytes) -> None:
        """Keep the certificate the control plane issued, once it is for our key and name."""
        cert = x509.load_pem_x509_certificate(cert_pem)
        ca = x509.load_pem_x509_certificate(ca_pem)
        if cert.public_key() != self._key().public_key():
            raise IdentityError("the certificate issued is not for this worker's key")
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        if names.get_values_for_type(x509.DNSName) != [worker_name(self.worker_id)]:
            raise IdentityError("the certificate issued does not name this worker")
        cert.verify_directly_issued_by(ca)
        for path, data in ((self.files.ca, ca_pem), (self.files.cert, cert_pem)):
            tmp = path.with_name(f".{path.name}.tmp")
            with tmp.open("wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            tmp.rename(path)

    async def join(self, control_url: str, token: str) -> TLSFiles:
        """Trade the one-time `token` for a certificate at the control plane's API."""
        url = f"{control_url.rstrip('/')}/v1/workers/{self.worker_id}/join"
        body = {"token": token, "csr": self.request().decode()}
        try:
            async with httpx.AsyncClient(timeout=JOIN_S) as http:
                resp = await http.post(url, json=body)
        except httpx.TransportError as e:
            raise IdentityError(f"cannot join at {url}: {e or type(e).__name__}") from None
        if resp.status_code != 200:
            raise IdentityError(f"joining at {url} was refused: {resp.status_code} {resp.text}")
        answer = resp.json()
        self.accept(answer["certificate"].encode(), answer["ca"].encode())
        return self.files
