"""The deployment CA: made once, then a leaf certificate minted (and cached) per SNI name."""

from __future__ import annotations

import collections
import ipaddress
import shutil
import ssl
import tempfile
import threading
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from space.pki import load_ca, make_ca, pem, sign_leaf, write_key

MAX_LEAVES = 4096


class CertificateAuthority:
    """Loads (or first makes, with `make`) the CA in `directory`; `server_context(name)` for TLS
    termination."""

    def __init__(self, directory: Path, make: bool = True) -> None:
        self.directory = directory
        self.cert_path = directory / "ca.pem"
        key_path = directory / "ca.key"
        if not self.cert_path.exists() or not key_path.exists():
            if not make:
                # A deployment's CA is given (a mounted secret): a new one would not be trusted.
                raise FileNotFoundError(f"{directory}: no CA (ca.pem and ca.key) to sign with")
            make_ca(self.cert_path, key_path, "SPACE gateway CA")
        # Read once, as root: a mounted CA stays unreadable to the unprivileged gateway.
        self._pem = self.cert_path.read_bytes()
        self.cert, self._key = load_ca(directory)
        # ssl loads a chain only from a file: each leaf passes through a private directory for a
        # moment. It is outside the state directory so an unprivileged gateway can own it.
        self.leaf_dir = Path(tempfile.mkdtemp(prefix="space-gateway-"))
        self._contexts: collections.OrderedDict[str, ssl.SSLContext] = collections.OrderedDict()
        self._lock = threading.Lock()

    def close(self) -> None:
        shutil.rmtree(self.leaf_dir, ignore_errors=True)

    @property
    def pem(self) -> bytes:
        return self._pem

    def server_context(self, name: str) -> ssl.SSLContext:
        with self._lock:
            ctx = self._contexts.get(name)
            if ctx is None:
                ctx = self._contexts[name] = self._mint(name)
                if len(self._contexts) > MAX_LEAVES:  # bounded even under an allow-all policy
                    self._contexts.popitem(last=False)
            self._contexts.move_to_end(name)
            return ctx

    def _mint(self, name: str) -> ssl.SSLContext:
        key = ec.generate_private_key(ec.SECP256R1())
        san: x509.GeneralName
        try:
            san = x509.IPAddress(ipaddress.ip_address(name))
        except ValueError:
            san = x509.DNSName(name)
        cert = sign_leaf(self.cert, self._key, key.public_key(), name, [san],
                         ExtendedKeyUsageOID.SERVER_AUTH, days=30)  # fmt: skip
        path = self.leaf_dir / f"{x509.random_serial_number():x}.pem"
        write_key(path, key, pem(cert))
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_alpn_protocols(["http/1.1"])  # the gateway speaks HTTP/1.1 to the guest
        try:
            ctx.load_cert_chain(path)
        finally:
            path.unlink()
        return ctx
