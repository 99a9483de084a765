"""A Prometheus endpoint of its own for a process that has no HTTP app to put /metrics in (the
controller) or must not serve it behind its API's credentials (a worker, whose API secret
controls its VMs): on a thread, for scrapes that send the deployment's metrics token."""

from __future__ import annotations

import hmac
import logging
import threading
from http.server import ThreadingHTTPServer

from prometheus_client import REGISTRY, CollectorRegistry, MetricsHandler

log = logging.getLogger(__name__)


def serve_metrics(address: str, token: str, registry: CollectorRegistry = REGISTRY) -> None:
    """Prometheus metrics at `address` (host:port), if it is set.

    A process that finds the port taken runs on without them (of controller replicas, the
    leader's are the ones that move)."""
    if not address:
        return
    host, _, port = address.rpartition(":")
    expected = f"Bearer {token}".encode()

    class Handler(MetricsHandler.factory(registry)):  # type: ignore[misc]
        def do_GET(self) -> None:
            sent = (self.headers.get("Authorization") or "").encode()
            if not hmac.compare_digest(sent, expected):
                self.send_response(401)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                self.wfile.write(b"metrics need Authorization: Bearer <metrics token>\n")
                return
            super().do_GET()

        def log_message(self, format: str, *args: object) -> None:
            pass

    try:
        server = ThreadingHTTPServer((host or "127.0.0.1", int(port)), Handler)
    except (OSError, ValueError) as e:
        log.warning("no metrics at %s: %s", address, e)
        return
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
