"""An async client for Firecracker's REST API, spoken over its unix socket.

One method per operation of Firecracker's published API (v1.16.1, Swagger 2.0); request and
response bodies are TypedDicts whose keys are the spec's field names, so mypy catches a
misspelt field before Firecracker does. The contract tests check every request this client can
send against the spec itself. A non-2xx answer raises `FirecrackerAPIError` with Firecracker's
`fault_message`; a lost connection raises `FirecrackerConnectionError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, NotRequired, TypedDict, cast

import httpx

from space.worker.vmm.base import VMMError

BASE_URL = "http://localhost"
DEFAULT_TIMEOUT = 30.0
SNAPSHOT_TIMEOUT = 300.0  # writing or mapping guest memory scales with its size
# Firecracker's API takes device ids from the URL path as-is (no percent-decoding) and accepts
# only alphanumerics and '_'; we keep to ASCII.
_RESOURCE_ID = re.compile(r"[A-Za-z0-9_]+")
_SUN_PATH_MAX = 107  # bytes of a unix socket path connect() accepts (sun_path, without NUL)


# --- request and response bodies (names as in the spec's `definitions`) ---------------------


class TokenBucket(TypedDict):
    size: int
    refill_time: int
    one_time_burst: NotRequired[int]


class RateLimiter(TypedDict, total=False):
    bandwidth: TokenBucket
    ops: TokenBucket


CpuTemplate = Literal["C3", "T2", "T2S", "T2CL", "T2A", "V1N1", "None"]


class MachineConfiguration(TypedDict):
    vcpu_count: int
    mem_size_mib: int
    smt: NotRequired[bool]
    track_dirty_pages: NotRequired[bool]
    cpu_template: NotRequired[CpuTemplate]
    huge_pages: NotRequired[Literal["None", "2M"]]


class BootSource(TypedDict):
    kernel_image_path: str
    boot_args: NotRequired[str]
    initrd_path: NotRequired[str]


class Drive(TypedDict):
    drive_id: str
    is_root_device: bool
    path_on_host: NotRequired[str]
    is_read_only: NotRequired[bool]
    partuuid: NotRequired[str]
    cache_type: NotRequired[Literal["Unsafe", "Writeback"]]
    io_engine: NotRequired[Literal["Sync", "Async"]]
    rate_limiter: NotRequired[RateLimiter]
    socket: NotRequired[str]  # vhost-user-block backend instead of path_on_host


class PartialDrive(TypedDict):
    drive_id: str
    path_on_host: NotRequired[str]
    rate_limiter: NotRequired[RateLimiter]


class Pmem(TypedDict):
    id: str
    path_on_host: str
    root_device: NotRequired[bool]
    read_only: NotRequired[bool]
    rate_limiter: NotRequired[RateLimiter]


class PartialPmem(TypedDict):
    id: str
    rate_limiter: NotRequired[RateLimiter]


class NetworkInterface(TypedDict):
    iface_id: str
    host_dev_name: str
    guest_mac: NotRequired[str]
    mtu: NotRequired[int]
    rx_rate_limiter: NotRequired[RateLimiter]
    tx_rate_limiter: NotRequired[RateLimiter]


class PartialNetworkInterface(TypedDict):
    iface_id: str
    rx_rate_limiter: NotRequired[RateLimiter]
    tx_rate_limiter: NotRequired[RateLimiter]


class Vsock(TypedDict):
    guest_cid: int
    uds_path: str


class EntropyDevice(TypedDict, total=False):
    rate_limiter: RateLimiter


class SerialDevice(TypedDict, total=False):
    serial_out_path: str
    rate_limiter: TokenBucket


LogLevel = Literal["Error", "Warning", "Info", "Debug", "Trace", "Off"]


class Logger(TypedDict, total=False):
    level: LogLevel
    log_path: str
    show_level: bool
    show_log_origin: bool
    module: str


class Metrics(TypedDict):
    metrics_path: str


class Balloon(TypedDict):
    amount_mib: int
    deflate_on_oom: bool
    stats_polling_interval_s: NotRequired[int]
    free_page_hinting: NotRequired[bool]
    free_page_reporting: NotRequired[bool]


class BalloonUpdate(TypedDict):
    amount_mib: int


class BalloonStatsUpdate(TypedDict):
    stats_polling_interval_s: int


class BalloonStartCmd(TypedDict, total=False):
    acknowledge_on_stop: bool


class BalloonStats(TypedDict):
    target_pages: int
    actual_pages: int
    target_mib: int
    actual_mib: int
    swap_in: NotRequired[int]
    swap_out: NotRequired[int]
    major_faults: NotRequired[int]
    minor_faults: NotRequired[int]
    free_memory: NotRequired[int]
    total_memory: NotRequired[int]
    available_memory: NotRequired[int]
    disk_caches: NotRequired[int]
    hugetlb_allocations: NotRequired[int]
    hugetlb_failures: NotRequired[int]
    oom_kill: NotRequired[int]
    alloc_stall: NotRequired[int]
    async_scan: NotRequired[int]
    direct_scan: NotRequired[int]
    async_reclaim: NotRequired[int]
    direct_reclaim: NotRequired[int]


class BalloonHintingStatus(TypedDict):
    host_cmd: int
    guest_cmd: NotRequired[int]


class MmdsConfig(TypedDict):
    network_interfaces: list[str]
    version: NotRequired[Literal["V1", "V2"]]
    ipv4_address: NotRequired[str]
    imds_compat: NotRequired[bool]


class MemoryHotplugConfig(TypedDict, total=False):
    total_size_mib: int
    slot_size_mib: int
    block_size_mib: int


class MemoryHotplugSizeUpdate(TypedDict, total=False):
    requested_size_mib: int


class MemoryHotplugStatus(TypedDict, total=False):
    total_size_mib: int
    slot_size_mib: int
    block_size_mib: int
    plugged_size_mib: int
    requested_size_mib: int


class CpuidRegisterModifier(TypedDict):
    register: Literal["eax", "ebx", "ecx", "edx"]
    bitmap: str


class CpuidLeafModifier(TypedDict):
    leaf: str
    subleaf: str
    flags: int
    modifiers: list[CpuidRegisterModifier]


class MsrModifier(TypedDict):
    addr: str
    bitmap: str


class ArmRegisterModifier(TypedDict):
    addr: str
    bitmap: str


class VcpuFeatures(TypedDict):
    index: int
    bitmap: str


class CpuConfig(TypedDict, total=False):
    kvm_capabilities: list[str]
    cpuid_modifiers: list[CpuidLeafModifier]
    msr_modifiers: list[MsrModifier]
    reg_modifiers: list[ArmRegisterModifier]
    vcpu_features: list[VcpuFeatures]


SnapshotType = Literal["Full", "Diff"]


class SnapshotCreateParams(TypedDict):
    snapshot_path: str
    mem_file_path: str
    snapshot_type: NotRequired[SnapshotType]


class MemoryBackend(TypedDict):
    backend_type: Literal["File", "Uffd"]
    backend_path: str  # the memory file, or the UDS of a process serving page faults


class NetworkOverride(TypedDict):
    iface_id: str
    host_dev_name: str


class VsockOverride(TypedDict):
    uds_path: str


class SnapshotLoadParams(TypedDict):
    # The deprecated `mem_file_path` and `enable_diff_snapshots` are left out on purpose:
    # `mem_backend` replaces the first, `track_dirty_pages` the second.
    snapshot_path: str
    mem_backend: MemoryBackend
    track_dirty_pages: NotRequired[bool]
    resume_vm: NotRequired[bool]
    network_overrides: NotRequired[list[NetworkOverride]]
    vsock_override: NotRequired[VsockOverride]
    clock_realtime: NotRequired[bool]


InstanceState = Literal["Not started", "Running", "Paused"]


class InstanceInfo(TypedDict):
    app_name: str
    id: str
    state: InstanceState
    vmm_version: str


class FirecrackerVersion(TypedDict):
    firecracker_version: str


FullVmConfiguration = TypedDict(
    "FullVmConfiguration",
    {
        "balloon": Balloon,
        "drives": list[Drive],
        "boot-source": BootSource,
        "cpu-config": CpuConfig,
        "logger": Logger,
        "machine-config": MachineConfiguration,
        "metrics": Metrics,
        "memory-hotplug": MemoryHotplugConfig,
        "mmds-config": MmdsConfig,
        "network-interfaces": list[NetworkInterface],
        "pmem": list[Pmem],
        "vsock": Vsock,
        "entropy": EntropyDevice,
    },
    total=False,
)

ActionType = Literal["FlushMetrics", "InstanceStart", "SendCtrlAltDel"]
VmState = Literal["Paused", "Resumed"]


# --- errors ----------------------------------------------------------------------------------


class FirecrackerAPIError(VMMError):
    """Firecracker answered an API request with an error status."""

    def __init__(self, method: str, path: str, status: int, fault_message: str) -> None:
        self.method = method
        self.path = path
        self.status = status
        self.fault_message = fault_message
        detail = fault_message or "(no message)"
        super().__init__(f"Firecracker refused {method} {path} (HTTP {status}): {detail}")


class InvalidResourceIdError(VMMError):
    """A device id Firecracker's API would refuse; nothing was sent."""


class FirecrackerConnectionError(VMMError):
    """The API socket could not be reached, or the connection broke before an answer."""

    def __init__(self, method: str, path: str, detail: str) -> None:
        self.method = method
        self.path = path
        super().__init__(f"Firecracker API {method} {path}: {detail}")


# --- reaching a unix socket whatever the length of its path ----------------------------------


class SocketPath:
    """A name under which `path` can be connect()ed, even when `path` is too long for that.

    A jailed VM's sockets live at `<chroot-base>/firecracker/<id>/root/...`, easily longer than
    the 107 bytes a unix socket address holds. Then we hold the socket's directory open and
    connect through `/proc/self/fd/<fd>/<name>` instead. `close()` releases the directory.
    """

    def __init__(self, path: Path) -> None:
        self._fd: int | None = None
        if len(os.fsencode(str(path))) <= _SUN_PATH_MAX:
            self.name = str(path)
        else:
            self._fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            self.name = f"/proc/self/fd/{self._fd}/{path.name}"

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@contextlib.contextmanager
def socket_path(path: Path) -> Iterator[str]:
    """`SocketPath` for the span of one connect()."""
    reachable = SocketPath(path)
    try:
        yield reachable.name
    finally:
        reachable.close()


# --- the client ------------------------------------------------------------------------------


def _resource_id(value: str) -> str:
    if not _RESOURCE_ID.fullmatch(value):
        raise InvalidResourceIdError(
            f"invalid Firecracker device id {value!r}: ids may contain only ASCII letters, "
            "digits and '_'"
        )
    return value


class FirecrackerClient:
    """Talks to one Firecracker process through its API socket."""

    def __init__(
        self,
        socket_path: Path,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        snapshot_timeout: float = SNAPSHOT_TIMEOUT,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self.snapshot_timeout = snapshot_timeout
        # The directory must exist now if the path is too long to connect to directly.
        self._address = SocketPath(socket_path)
        self._http = httpx.AsyncClient(
            transport=transport or httpx.AsyncHTTPTransport(uds=self._address.name),
            base_url=BASE_URL,
            timeout=timeout,
        )

    async def aclose(self) -> None:
        await self._http.aclose()
        self._address.close()

    async def __aenter__(self) -> FirecrackerClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def wait_ready(
        self, timeout: float = 5.0, *, alive: Callable[[], bool] | None = None
    ) -> None:
        """Wait until the API socket accepts connections, for at most `timeout` seconds.

        `alive` lets the caller stop waiting early when the process has already exited.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        delay = 0.002
        while True:
            if alive is not None and not alive():
                raise FirecrackerConnectionError(
                    "CONNECT", str(self.socket_path), "the process exited before its API was up"
                )
            if self.socket_path.exists():
                # The socket file appears at bind(); connecting proves listen() happened too.
                with contextlib.suppress(ConnectionRefusedError, FileNotFoundError):
                    _, writer = await asyncio.open_unix_connection(self._address.name)
                    writer.close()
                    with contextlib.suppress(OSError):
                        await writer.wait_closed()
                    return
            if loop.time() >= deadline:
                raise FirecrackerConnectionError(
                    "CONNECT",
                    str(self.socket_path),
                    f"the API socket did not accept connections within {timeout:g} s",
                )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

    async def request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = None,
    ) -> Any:
        """Send one request; returns the decoded JSON answer, or None for 204 No Content."""
        try:
            response = await self._http.request(
                method,
                path,
                content=None if body is None else json.dumps(body).encode(),
                headers={"Content-Type": "application/json"} if body is not None else None,
                timeout=self.timeout if timeout is None else timeout,
            )
        except httpx.TimeoutException:
            limit = self.timeout if timeout is None else timeout
            raise FirecrackerConnectionError(
                method, path, f"no answer within {limit:g} s"
            ) from None
        except httpx.TransportError as exc:
            raise FirecrackerConnectionError(
                method, path, f"cannot reach {self.socket_path}: {exc or type(exc).__name__}"
            ) from exc
        if not response.is_success:
            raise FirecrackerAPIError(method, path, response.status_code, _fault(response))
        if response.status_code == 204 or not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            raise FirecrackerAPIError(
                method, path, response.status_code, f"answer is not JSON: {response.text[:200]!r}"
            ) from None

    # -- instance -----------------------------------------------------------------------------

    async def get_instance_info(self) -> InstanceInfo:
        return cast(InstanceInfo, await self.request("GET", "/"))

    async def get_version(self) -> FirecrackerVersion:
        return cast(FirecrackerVersion, await self.request("GET", "/version"))

    async def get_vm_config(self) -> FullVmConfiguration:
        return cast(FullVmConfiguration, await self.request("GET", "/vm/config"))

    async def action(self, action_type: ActionType) -> None:
        await self.request("PUT", "/actions", {"action_type": action_type})

    async def instance_start(self) -> None:
        await self.action("InstanceStart")

    async def send_ctrl_alt_del(self) -> None:
        await self.action("SendCtrlAltDel")

    async def flush_metrics(self) -> None:
        await self.action("FlushMetrics")

    async def patch_vm_state(self, state: VmState) -> None:
        await self.request("PATCH", "/vm", {"state": state})

    async def pause(self) -> None:
        await self.patch_vm_state("Paused")

    async def resume(self) -> None:
        await self.patch_vm_state("Resumed")

    # -- machine ------------------------------------------------------------------------------

    async def get_machine_config(self) -> MachineConfiguration:
        return cast(MachineConfiguration, await self.request("GET", "/machine-config"))

    async def put_machine_config(self, config: MachineConfiguration) -> None:
        await self.request("PUT", "/machine-config", config)

    async def patch_machine_config(self, config: MachineConfiguration) -> None:
        # The spec gives PATCH the same schema as PUT, vcpu_count and mem_size_mib included.
        await self.request("PATCH", "/machine-config", config)

    async def put_cpu_config(self, config: CpuConfig) -> None:
        await self.request("PUT", "/cpu-config", config)

    async def put_boot_source(self, boot_source: BootSource) -> None:
        await self.request("PUT", "/boot-source", boot_source)

    # -- devices ------------------------------------------------------------------------------

    async def put_drive(self, drive: Drive) -> None:
        await self.request("PUT", f"/drives/{_resource_id(drive['drive_id'])}", drive)

    async def patch_drive(self, drive: PartialDrive) -> None:
        await self.request("PATCH", f"/drives/{_resource_id(drive['drive_id'])}", drive)

    async def put_pmem(self, pmem: Pmem) -> None:
        await self.request("PUT", f"/pmem/{_resource_id(pmem['id'])}", pmem)

    async def patch_pmem(self, pmem: PartialPmem) -> None:
        await self.request("PATCH", f"/pmem/{_resource_id(pmem['id'])}", pmem)

    async def put_network_interface(self, iface: NetworkInterface) -> None:
        await self.request("PUT", f"/network-interfaces/{_resource_id(iface['iface_id'])}", iface)

    async def patch_network_interface(self, iface: PartialNetworkInterface) -> None:
        await self.request("PATCH", f"/network-interfaces/{_resource_id(iface['iface_id'])}", iface)

    async def put_vsock(self, vsock: Vsock) -> None:
        await self.request("PUT", "/vsock", vsock)

    async def put_entropy(self, entropy: EntropyDevice | None = None) -> None:
        await self.request("PUT", "/entropy", entropy or {})

    async def put_serial(self, serial: SerialDevice) -> None:
        await self.request("PUT", "/serial", serial)

    async def put_balloon(self, balloon: Balloon) -> None:
        await self.request("PUT", "/balloon", balloon)

    async def patch_balloon(self, update: BalloonUpdate) -> None:
        await self.request("PATCH", "/balloon", update)

    async def get_balloon(self) -> Balloon:
        return cast(Balloon, await self.request("GET", "/balloon"))

    async def get_balloon_statistics(self) -> BalloonStats:
        return cast(BalloonStats, await self.request("GET", "/balloon/statistics"))

    async def patch_balloon_statistics(self, update: BalloonStatsUpdate) -> None:
        await self.request("PATCH", "/balloon/statistics", update)

    async def start_balloon_hinting(self, command: BalloonStartCmd | None = None) -> None:
        await self.request("PATCH", "/balloon/hinting/start", command or {})

    async def get_balloon_hinting_status(self) -> BalloonHintingStatus:
        return cast(BalloonHintingStatus, await self.request("GET", "/balloon/hinting/status"))

    async def stop_balloon_hinting(self) -> None:
        await self.request("PATCH", "/balloon/hinting/stop")

    async def put_memory_hotplug(self, config: MemoryHotplugConfig) -> None:
        await self.request("PUT", "/hotplug/memory", config)

    async def patch_memory_hotplug(self, update: MemoryHotplugSizeUpdate) -> None:
        await self.request("PATCH", "/hotplug/memory", update)

    async def get_memory_hotplug(self) -> MemoryHotplugStatus:
        return cast(MemoryHotplugStatus, await self.request("GET", "/hotplug/memory"))

    # -- observability ------------------------------------------------------------------------

    async def put_logger(self, logger: Logger) -> None:
        await self.request("PUT", "/logger", logger)

    async def put_metrics(self, metrics: Metrics) -> None:
        await self.request("PUT", "/metrics", metrics)

    # -- MMDS (the guest's metadata service) ----------------------------------------------------

    async def put_mmds(self, contents: Mapping[str, Any]) -> None:
        await self.request("PUT", "/mmds", contents)

    async def patch_mmds(self, contents: Mapping[str, Any]) -> None:
        await self.request("PATCH", "/mmds", contents)

    async def get_mmds(self) -> dict[str, Any]:
        return cast(dict[str, Any], await self.request("GET", "/mmds"))

    async def put_mmds_config(self, config: MmdsConfig) -> None:
        await self.request("PUT", "/mmds/config", config)

    # -- snapshots ----------------------------------------------------------------------------

    async def create_snapshot(self, params: SnapshotCreateParams) -> None:
        await self.request("PUT", "/snapshot/create", params, timeout=self.snapshot_timeout)

    async def load_snapshot(self, params: SnapshotLoadParams) -> None:
        await self.request("PUT", "/snapshot/load", params, timeout=self.snapshot_timeout)


def _fault(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:500]
    if isinstance(body, dict) and isinstance(body.get("fault_message"), str):
        return str(body["fault_message"])
    return response.text.strip()[:500]
