"""What the worker uses to push policies to the gateway and read its audit log."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from space.gateway.policy import Policy, SandboxPolicy


@dataclass(frozen=True)
class Traffic:
    """A sandbox's bytes by host, (sent, received), in one run of counts (`epoch`)."""

    epoch: str
    hosts: dict[str, tuple[int, int]]


class GatewayError(Exception):
    """The gateway refused a request or could not be reached."""


class GatewayClient:
    def __init__(self, socket_path: Path, timeout: float = 5.0) -> None:
        self._http = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=str(socket_path)),
            base_url="http://gateway",
            timeout=timeout,
        )

    async def __aenter__(self) -> GatewayClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def _call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            response = await self._http.request(method, path, **kw)
        except httpx.TransportError as e:
            raise GatewayError(f"gateway unreachable: {e}") from None
        if response.status_code >= 400 and response.status_code != 404:
            raise GatewayError(f"gateway: {response.status_code} {response.text}")
        return response

    async def health(self) -> dict[str, Any]:
        result: dict[str, Any] = (await self._call("GET", "/health")).json()
        return result

    async def set_policy(self, sandbox_id: str, address: str, policy: Policy) -> None:
        body = SandboxPolicy(address=address, policy=policy).model_dump_json()
        await self._call("PUT", f"/sandboxes/{sandbox_id}", content=body)

    async def sandbox(self, sandbox_id: str) -> dict[str, Any] | None:
        """Its address, policy (no secret values), open connections and refusal counts."""
        response = await self._call("GET", f"/sandboxes/{sandbox_id}")
        return None if response.status_code == 404 else dict(response.json())

    async def remove(self, sandbox_id: str) -> bool:
        return (await self._call("DELETE", f"/sandboxes/{sandbox_id}")).status_code == 204

    async def audit(
        self, sandbox: str | None = None, after: int = 0, limit: int = 1000
    ) -> list[dict[str, Any]]:
        params: dict[str, Any] = {"after": after, "limit": limit}
        if sandbox is not None:
            params["sandbox"] = sandbox
        events: list[dict[str, Any]] = (await self._call("GET", "/audit", params=params)).json()[
            "events"
        ]
        return events

    async def traffic(self) -> dict[str, Traffic]:
        """Each sandbox's bytes by host since the gateway took it on."""
        got = (await self._call("GET", "/traffic")).json()
        return {sid: Traffic(t["epoch"], {h: (int(c[0]), int(c[1])) for h, c in t["hosts"].items()})
                for sid, t in got.items()}  # fmt: skip

    async def ca_pem(self) -> bytes:
        return (await self._call("GET", "/ca.pem")).content
