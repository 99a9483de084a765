"""The deployment CA: made once, then a leaf certificate minted (and cached) per SNI name."""

from __future__ import annotations

import collections
import datetime
import ipaddress
import os
import shutil
import ssl
import tempfile
import threading
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_DAY = datetime.timedelta(days=1)
MAX_LEAVES = 4096


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def make_ca(cert_path: Path, key_path: Path, common: str = "SPACE gateway CA") -> None:
    """Write a new CA (EC P-256, ten years) to `cert_path` and `key_path` (mode 0600)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common))
        .issuer_name(_name(common))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _DAY)
        .not_valid_after(now + 3650 * _DAY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_path.parent.mkdir(parents=True, exist_ok=True)
    _write_key(key_path, key)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey, then: bytes = b"") -> None:
    """A private key (and what follows it, e.g. its certificate) in a file only we can read."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        f.write(then)


class CertificateAuthority:
    """Loads (or first makes) the CA in `directory`; `server_context(name)` for TLS termination."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.cert_path = directory / "ca.pem"
        key_path = directory / "ca.key"
        if not self.cert_path.exists() or not key_path.exists():
            make_ca(self.cert_path, key_path)
        self.cert = x509.load_pem_x509_certificate(self.cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{key_path}: expected an EC private key")
        self._key = key
        # ssl loads a chain only from a file: each leaf passes through a private directory for a
        # moment. It is outside the state directory so an unprivileged gateway can own it.
        self.leaf_dir = Path(tempfile.mkdtemp(prefix="space-gateway-"))
        self._contexts: collections.OrderedDict[str, ssl.SSLContext] = collections.OrderedDict()
        self._lock = threading.Lock()

    def close(self) -> None:
        shutil.rmtree(self.leaf_dir, ignore_errors=True)

    @property
    def pem(self) -> bytes:
        return self.cert_path.read_bytes()

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
        now = datetime.datetime.now(datetime.UTC)
        san: x509.GeneralName
        try:
            san = x509.IPAddress(ipaddress.ip_address(name))
        except ValueError:
            san = x509.DNSName(name)
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name[:64]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _DAY)
            .not_valid_after(now + 30 * _DAY)
            .add_extension(x509.SubjectAlternativeName([san]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        path = self.leaf_dir / f"{x509.random_serial_number():x}.pem"
        _write_key(path, key, cert.public_bytes(serialization.Encoding.PEM))
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_alpn_protocols(["http/1.1"])  # the gateway speaks HTTP/1.1 to the guest
        try:
            ctx.load_cert_chain(path)
        finally:
            path.unlink()
        return ctx
