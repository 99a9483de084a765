"""The worker keeps its gateway running: when it exits, it is started again (with backoff) and
every live sandbox's policy is installed again, since the gateway keeps them in memory only.

While the gateway is down nothing gets out of any sandbox (their traffic has nowhere to go but
the gateway's ports), and the worker reports itself unhealthy so that it gets no new VMs.
"""

from __future__ import annotations

import asyncio
import logging
import time

from space.gateway.client import GatewayError
from space.gateway.process import GatewayProcess
from space.worker.network.egress import Egress
from space.worker.network.rules import NetworkError

log = logging.getLogger(__name__)

BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0)
STABLE_S = 30.0  # a gateway that ran this long resets the backoff


class GatewaySupervisor:
    def __init__(self, process: GatewayProcess, egress: Egress) -> None:
        self.process = process
        self.egress = egress
        self.up = True
        self.restarts = 0
        self.problem: str | None = None

    async def run(self) -> None:
        failures = 0
        while True:
            started = time.monotonic()
            code = await self.process.wait()
            self.up = False
            self.problem = f"the gateway exited with {code}; restarting it"
            log.error("gateway exited with %s; restarting it", code)
            if time.monotonic() - started > STABLE_S:
                failures = 0
            while True:
                await asyncio.sleep(BACKOFF_S[min(failures, len(BACKOFF_S) - 1)])
                failures += 1
                try:
                    client = await self.process.start()
                    await client.close()  # the egress's own client talks to the same socket
                    await self.egress.reinstall()
                except (GatewayError, NetworkError, OSError) as e:
                    self.problem = f"the gateway does not start: {e}"
                    log.error("gateway restart failed: %s", e)
                    continue
                break
            self.restarts += 1
            self.up, self.problem = True, None
            log.info("gateway restarted (%d so far); policies installed again", self.restarts)
