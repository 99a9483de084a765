"""Secrets at rest: AES-256-GCM, with the owner and name as associated data (a sealed value
moved to another row does not open), and key ids so keys can be rotated."""

from __future__ import annotations

import os
from collections.abc import Callable

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

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
