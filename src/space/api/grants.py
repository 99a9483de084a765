"""Grants: what a token this deployment sealed says, for tokens that stand in for an API key
(preview links, E2B's access tokens). A grant is sealed with the secrets key (AES-GCM: it
cannot be forged, altered or read) for one use, its context, and is good for nothing else; it
names the API key that made it, so revoking the key ends it at once."""

from __future__ import annotations

import base64
import binascii
import json
import time
from dataclasses import dataclass

from space.db.sealing import Sealer, SealError

CONTEXT = "preview link"  # the context of a link's grant
MAX_TOKEN = 1024
ANY_PORT = 0  # a grant to every port of its sandbox


@dataclass(frozen=True)
class Grant:
    """What a token says: the key that made it, the sandbox and the port it opens (`ANY_PORT`:
    every one), until when."""

    key_id: str
    sandbox_id: str
    port: int
    expires: int  # unix time

    def opens(self, sandbox_id: str, port: int) -> bool:
        return (
            self.sandbox_id == sandbox_id
            and self.port in (port, ANY_PORT)
            and time.time() < self.expires
        )

    def seal(self, sealer: Sealer, context: str = CONTEXT) -> str:
        plain = json.dumps([self.key_id, self.sandbox_id, self.port, self.expires]).encode()
        kid, blob = sealer.seal(plain, context)
        return f"{kid}.{base64.urlsafe_b64encode(blob).decode().rstrip('=')}"

    @classmethod
    def open(cls, sealer: Sealer, token: str, context: str = CONTEXT) -> Grant | None:
        """The grant of a token this deployment sealed for `context`; None for anything else."""
        kid, _, b64 = token.rpartition(".")
        if not kid or len(token) > MAX_TOKEN:
            return None
        try:
            blob = base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4))
            key_id, sandbox_id, port, expires = json.loads(sealer.open(kid, blob, context))
        except (SealError, binascii.Error, ValueError, TypeError):
            return None
        return cls(str(key_id), str(sandbox_id), int(port), int(expires))
