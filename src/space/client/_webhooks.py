"""For receivers of SPACE's webhooks: check a delivery's `Space-Signature` before trusting it."""

from __future__ import annotations

from space.webhooks.signing import WebhookSignatureError
from space.webhooks.signing import verify as verify_webhook

__all__ = ["WebhookSignatureError", "verify_webhook"]
