"""Secrets at rest: AES-256-GCM, with the owner and name as associated data (a sealed value
moved to another row does not open), and key ids so keys can be rotated."""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

NONCE_BYTES = 12


class SealError(Exception):
    pass


class Sealer:
    def __init__(
        self,
        keys: list[tuple[str, bytes]],
        reload: Callable[[], list[tuple[str, bytes]]] | None = None,
    ) -> None:
        """`keys`: (id, 32-byte key), the one to seal with first. `reload` gives them again,
        for when a value sealed with a key this process has not seen yet (a rotation) turns up.
        """
        self._reload = reload
        self._load(keys)

    def _load(self, keys: list[tuple[str, bytes]]) -> None:
        self.current = keys[0][0]
        self._keys = {kid: AESGCM(key) for kid, key in keys}
        # A key of its own for codes anyone may recompute who holds it: never the cipher's.
        self._mac_keys = {kid: _derive(key, b"space mac") for kid, key in keys}

    def key_ids(self) -> list[str]:
        """The configured keys' ids, the current one first."""
        return [self.current, *(kid for kid in self._keys if kid != self.current)]

    def mac(self, data: bytes, context: str, key_id: str | None = None) -> tuple[str, bytes]:
        """An unforgeable code of `data` for `context` (HMAC-SHA-256), with the current key or
        `key_id`'s: the same every time, so whoever holds the key can check it by making it
        again. SealError for a key that is not configured."""
        kid = key_id or self.current
        if kid not in self._mac_keys and self._reload is not None:
            self._load(self._reload())
        key = self._mac_keys.get(kid)
        if key is None:
            raise SealError(f"no key {kid} is configured")
        return kid, hmac.new(key, context.encode() + b"\0" + data, hashlib.sha256).digest()

    def seal(self, plaintext: bytes, context: str) -> tuple[str, bytes]:
        nonce = os.urandom(NONCE_BYTES)
        blob = nonce + self._keys[self.current].encrypt(nonce, plaintext, context.encode())
        return self.current, blob

    def open(self, key_id: str, blob: bytes, context: str) -> bytes:
        if key_id not in self._keys and self._reload is not None:
            self._load(self._reload())
        aead = self._keys.get(key_id)
        if aead is None:
            raise SealError(f"sealed with key {key_id}, which is not configured any more")
        try:
            return aead.decrypt(blob[:NONCE_BYTES], blob[NONCE_BYTES:], context.encode())
        except InvalidTag:
            raise SealError(
                "a sealed value does not open (wrong key, or it was tampered with)"
            ) from None


def _derive(key: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(key)
