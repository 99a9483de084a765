"""A delivery's signature, which a receiver checks before it believes the body.

`Space-Signature: t=<unix time>,v1=<hex HMAC-SHA256 of "<t>." + body>`, with the endpoint's own
secret. The time is inside what is signed, so a receiver that refuses stale times (`verify`,
five minutes by default) cannot be sent a recorded delivery again later. Standard library only:
the SDK exposes `verify` to receivers (`space.verify_webhook`).
"""

from __future__ import annotations

import hashlib
import hmac
import time

HEADER = "Space-Signature"
TOLERANCE_S = 300


class WebhookSignatureError(ValueError):
    """The delivery was not signed with this secret, or was signed too long ago."""


def sign(secret: str, body: bytes, at: int | None = None) -> str:
    at = int(time.time()) if at is None else at
    return f"t={at},v1={_mac(secret, at, body)}"


def verify(
    secret: str, header: str, body: bytes, *, tolerance_s: float = TOLERANCE_S,
    now: float | None = None,
) -> None:  # fmt: skip
    """Return if `header` signs `body` with `secret` within `tolerance_s` of now; else raise
    WebhookSignatureError saying why."""
    fields: dict[str, list[str]] = {}
    for part in header.split(","):
        name, _, value = part.strip().partition("=")
        fields.setdefault(name, []).append(value)
    try:
        at = int(fields["t"][0])
    except (KeyError, ValueError):
        raise WebhookSignatureError("the signature has no time") from None
    now = time.time() if now is None else now
    if abs(now - at) > tolerance_s:
        raise WebhookSignatureError(f"the signature is {now - at:.0f} s old: a replay?")
    expected = _mac(secret, at, body)
    if not any(hmac.compare_digest(expected, given) for given in fields.get("v1", [])):
        raise WebhookSignatureError("the signature does not match the body and secret")


def _mac(secret: str, at: int, body: bytes) -> str:
    return hmac.new(secret.encode(), f"{at}.".encode() + body, hashlib.sha256).hexdigest()
