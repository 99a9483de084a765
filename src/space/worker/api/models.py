"""The worker API on the wire: every request body and answer, typed once for both sides.

The worker's server (`space.worker.api.server`) validates what it receives with these models and
answers with them; the client (`space.worker.api.client`) builds its requests from them and
parses the answers into them. docs/worker-api.md describes the calls.

Lifecycle calls carry the controller leader's fencing epoch in `EPOCH_HEADER`; a worker refuses
an epoch older than the newest it has seen (412), so a leader that was replaced cannot act any
more. Data-plane calls (exec, files, audit) carry none.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_serializer,
    field_validator,
    model_validator,
)

from space.gateway.policy import Policy
from space.release import UNVERSIONED

EPOCH_HEADER = "Space-Epoch"
NDJSON = "application/x-ndjson"

ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"
HOSTNAME = r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,62})$"
TEMPLATE = r"^[a-z0-9][a-z0-9._-]{0,63}$"
VM_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
VOLUME_ID = re.compile(r"^[a-z0-9][a-z0-9-]{2,19}$")  # it is the drive's serial: 20 bytes at most
# Every VM has this many extra drives: empty slots, or the sandbox's volumes. A restore can put
# a volume in a slot (same devices, another file), so volumes need no boot.
VOLUME_SLOTS = 2
MAX_PATH = 4096
# The guest TCP WebSocket (/vms/{id}/tcp/{port}): binary messages are the connection's bytes both
# ways; the client's text message TCP_EOF ends its side; TCP_REST says the connection is only
# kept for later (it stops counting as the VM's use until its next bytes); the worker closes with
# 1000 once the guest's side ended and everything was sent, or with 4000 + an HTTP status and the
# reason when the connection could not be made or broke.
TCP_EOF = "eof"
TCP_REST = "rest"
TCP_FRAME = 32 << 10  # bytes per message, under what WebSocket clients accept
MAX_CONTEXT_B64 = 96 << 20  # a build context of up to 64 MiB (files to copy into a template)

VMState = Literal["running", "paused", "suspended", "error", "unresponsive"]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Answer(BaseModel):
    """What a worker sends back; unknown members are ignored (a newer worker may add some)."""

    model_config = ConfigDict(extra="ignore")


EnvName = Annotated[str, Field(pattern=ENV_NAME)]
EnvValue = Annotated[str, Field(max_length=32768, pattern=r"^[^\x00]*$")]
Env = dict[EnvName, EnvValue]


# --- lifecycle --------------------------------------------------------------------------------


ARTIFACT = r"^[^\s@]+@sha256:[0-9a-f]{64}$"


class VolumeSpec(Strict):
    id: str = Field(pattern=VOLUME_ID.pattern)
    size_mib: int = Field(ge=1, le=1 << 22)
    path: str = Field(pattern=r"^/[^\x00]*$", max_length=MAX_PATH)
    read_only: bool = False


class AdoptVolume(Strict):
    """POST /volumes/{id}/adopt: a detached volume's image, pulled from the registry; the
    volume lives here from then on."""

    artifact: str = Field(max_length=600, pattern=ARTIFACT)
    size_mib: int = Field(ge=1, le=1 << 22)  # what its image may be at most


class PushVolume(Strict):
    """POST /volumes/{id}/push: of the volume as the control plane last placed it (its
    `generation`): a push under way of an earlier one is not this one."""

    generation: int = Field(ge=0)


class VolumePushed(Answer):
    """POST /volumes/{id}/push: the detached volume's image, now in the registry."""

    id: str
    artifact: str


class TemplateBuild(Strict):
    """One build of a template as pushed to the registry."""

    digest: str = Field(pattern=r"^[0-9a-f]{16}$")
    artifact: str = Field(max_length=600, pattern=ARTIFACT)


class CreateVM(Strict):
    """PUT /vms/{id}: a running VM of this shape (the existing one if it is already there; a
    VM whose VMM died is booted again from its own disk)."""

    template: str = Field("base", pattern=TEMPLATE)
    vcpus: int = Field(1, ge=1, le=64)
    memory_mib: int = Field(256, ge=128, le=1 << 20)
    env: Env = Field(default_factory=dict, max_length=256)
    hostname: str | None = Field(None, pattern=HOSTNAME)
    disk_mib: int = Field(0, ge=0, le=1 << 20)  # 0: the template's own size
    warm: bool = False  # a warm-pool member: exec paths are run once before it answers
    volumes: list[VolumeSpec] = Field(default_factory=list, max_length=VOLUME_SLOTS)
    network: Policy | None = None  # what the gateway lets out (default: nothing)
    # A template in the registry: the build to run, pulled first if this worker lacks it.
    template_build: TemplateBuild | None = None


class VMCreated(Answer):
    id: str
    state: VMState
    boot: Literal["restore", "cold", "reboot", "fork"]
    took_ms: float


class CheckpointTaken(Answer):
    """POST /vms/{id}/checkpoints/{checkpoint}: memory, devices and disk of a running VM, taken
    while it runs on; `paused_ms` is how long its guest was stopped for it."""

    id: str
    vm_id: str
    size_bytes: int
    paused_ms: float
    took_ms: float


class ForkChild(Strict):
    id: str = Field(pattern=VM_ID.pattern)
    hostname: str | None = Field(None, pattern=HOSTNAME)
    env: Env = Field(default_factory=dict, max_length=256)
    network: Policy | None = None  # the child's own egress policy (default: nothing out)


MAX_FORK = 16


class ForkVM(Strict):
    """POST /vms/{id}/fork: running children of the VM's state now, or of a checkpoint."""

    children: list[ForkChild] = Field(min_length=1, max_length=MAX_FORK)
    checkpoint: str | None = Field(None, pattern=VM_ID.pattern)


class Forked(Answer):
    children: list[VMCreated]
    paused_ms: float  # how long the parent was stopped (0 from a checkpoint)
    took_ms: float


class ClaimVM(Strict):
    """POST /vms/{id}/claim: a warm-pool VM handed to a tenant."""

    env: Env = Field(default_factory=dict, max_length=256)
    network: Policy | None = None


class VMStatusAnswer(Answer):
    id: str
    state: VMState
    # A suspend's: where its snapshot is in the registry (any worker can resume it from there).
    artifact: str | None = None


class AdoptVM(Strict):
    """POST /vms/{id}/adopt: a sandbox suspended on another worker, pulled from the registry
    and suspended here, to be resumed here (its policy comes with the resume)."""

    artifact: str = Field(max_length=600, pattern=ARTIFACT)


class VMReport(Answer):
    id: str
    state: VMState
    reason: str | None = None
    policy: bool = True  # False: its egress policy died with an earlier worker process
    crashed: bool = False  # its VMM is gone, its disk is here: a create boots it again
    rebooted: bool = False  # its VMM died once and it was booted again from its disk
    idle_s: float = 0.0  # since its last exec, file or ingress call (0 while one is open)


class Resources(Answer):
    vcpus: int
    memory_mib: int
    disk_mib: int = 0


class Shares(Answer):
    """What one sandbox may take of the host (0: no limit)."""

    disk_mib_s: int = 0  # its drives together, reads and writes together
    disk_iops: int = 0
    net_mbit: int = 0  # each way


class Health(Answer):
    """GET /health: the worker's VMs, capacity and use, and whether it can take work."""

    worker_id: str
    instance: str = ""
    version: str = UNVERSIONED  # its release (space.release): what an older worker did not say
    epoch: int = 0  # the newest leader epoch this worker has seen
    healthy: bool = True
    problems: list[str] = Field(default_factory=list)  # why it is not healthy, if it is not
    vms: list[VMReport] = Field(default_factory=list)
    capacity: Resources
    used: Resources
    overhead_mib: int = 0  # what a VMM costs beyond its guest's RAM, measured
    admit_memory: Literal["measured", "guest"] = "measured"  # how `used.memory_mib` counts
    ksm_saved_mib: int | None = None  # guest memory KSM merged away; None: no KSM here
    mem_available_mib: int | None = None
    disk_free_mib: int | None = None
    templates: dict[str, str] = Field(default_factory=dict)  # name: digest of its newest build
    registry: bool = False  # it pushes templates and snapshots to the deployment's registry
    shares: Shares = Field(default_factory=Shares)


class Reconcile(Strict):
    keep: list[str] = Field(max_length=100_000)


class Reconciled(Answer):
    removed: list[str]


# --- templates --------------------------------------------------------------------------------


class CheckpointSource(Strict):
    vm_id: str = Field(pattern=VM_ID.pattern)
    checkpoint_id: str = Field(pattern=VM_ID.pattern)


class BuildRequest(Strict):
    """A build of a spec, or the making of a template of a checkpoint on the worker."""

    spec: str = Field(default="", max_length=1 << 20)
    context: str = Field(default="", max_length=MAX_CONTEXT_B64, description="base64 of a tar")
    environ: Env = Field(default_factory=dict, max_length=64)
    checkpoint: CheckpointSource | None = None
    # The same request again (a controller retrying after a crash) gets the same build.
    request_id: str = Field("", max_length=64)

    @model_validator(mode="after")
    def one_source(self) -> BuildRequest:
        check_build_source(self.spec, self.checkpoint, self.context, self.environ)
        return self


def check_build_source(spec: str, checkpoint: object, context: str, environ: Env) -> None:
    """A build is of a spec, or of a checkpoint, which takes no context or environ."""
    if bool(spec) == (checkpoint is not None):
        raise ValueError("give either a spec or a checkpoint")
    if checkpoint is not None and (context or environ):
        raise ValueError("a build of a checkpoint takes no context or environ")


class BuildStatus(Answer):
    id: str
    name: str
    state: Literal["building", "ready", "failed"]
    error: str | None = None
    record: dict[str, Any] | None = None


# --- data plane -------------------------------------------------------------------------------


PROCESS_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:-]{0,63}$")


def check_tag(tag: str) -> str:
    """A process's tag: never all digits, which would read as a pid."""
    if not PROCESS_TAG.match(tag) or tag.isdigit():
        raise ValueError(
            "a tag is 1-64 of letters, digits and _.:-, starts with a letter, digit or _, "
            "and is not a number"
        )
    return tag


class ExecRequest(Strict):
    cmd: str | None = Field(None, min_length=1, pattern=r"^[^\x00]*$")
    argv: list[Annotated[str, Field(pattern=r"^[^\x00]*$")]] | None = Field(None, min_length=1)
    env: Env = Field(default_factory=dict, max_length=256)
    cwd: str | None = Field(None, pattern=r"^/[^\x00]*$", max_length=MAX_PATH)
    user: (
        Annotated[str, Field(min_length=1, max_length=64)] | Annotated[int, Field(ge=0)] | None
    ) = None
    timeout: float | None = Field(None, gt=0)
    stdin: bytes | None = Field(None, description="base64")
    pty: bool = False
    rows: int = Field(24, ge=1, le=1000)
    cols: int = Field(80, ge=1, le=1000)
    background: bool = Field(False, description="it outlives the request that started it")
    tag: str | None = Field(None, description="names the running process (implies background)")
    keep_stdin: bool = Field(False, description="stdin stays open after `stdin` was written")

    @field_validator("tag")
    @classmethod
    def valid_tag(cls, tag: str | None) -> str | None:
        return None if tag is None else check_tag(tag)

    @field_validator("stdin", mode="before")
    @classmethod
    def decode_stdin(cls, value: object) -> object:
        if value is None or isinstance(value, bytes):
            return value
        if not isinstance(value, str):
            raise ValueError("stdin must be a base64 string")
        try:
            return base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("stdin is not valid base64") from None

    @model_validator(mode="after")
    def one_command(self) -> ExecRequest:
        if (self.cmd is None) == (self.argv is None):
            raise ValueError("give exactly one of 'cmd' (a shell command) or 'argv' (a list)")
        if self.tag is not None:
            self.background = True
        return self

    @property
    def command(self) -> str | list[str]:
        return self.cmd if self.cmd is not None else list(self.argv or [])

    @field_serializer("stdin")
    def encode_stdin(self, stdin: bytes | None) -> str | None:
        return None if stdin is None else base64.b64encode(stdin).decode()

    def wire(self) -> dict[str, Any]:
        """The body as JSON sends it."""
        return self.model_dump(mode="json", exclude_none=True)


class ExecStart(Answer):
    type: Literal["start"] = "start"
    pid: int
    tag: str | None = None
    dropped: int = 0  # on an attach: output the process wrote that no longer was kept


class ProcessInfo(Answer):
    pid: int
    tag: str | None = None
    cmd: str | None = None
    argv: list[str] | None = None
    cwd: str | None = None
    pty: bool = False
    background: bool = False
    started_at: float
    running: bool
    exit_code: int | None = None
    signal: int | None = None


class ProcessList(Answer):
    processes: list[ProcessInfo]


class ProcessSignal(Strict):
    signal: int = Field(ge=1, le=64)


class TerminalSize(Strict):
    rows: int = Field(ge=1, le=1000)
    cols: int = Field(ge=1, le=1000)


class ExecOutput(Answer):
    type: Literal["stdout", "stderr"]
    data: str  # base64

    @property
    def raw(self) -> bytes:
        return base64.b64decode(self.data)


class ExecExit(Answer):
    type: Literal["exit"] = "exit"
    exit_code: int | None
    signal: int | None = None
    timed_out: bool = False
    duration_ms: float = 0.0


class ExecFailed(Answer):
    type: Literal["error"] = "error"
    code: str
    message: str
    status: int | None = None


ExecEvent = Annotated[ExecStart | ExecOutput | ExecExit | ExecFailed, Field(discriminator="type")]


class FileEntry(Answer):
    name: str
    path: str
    type: str
    size: int
    mode: int
    uid: int
    gid: int
    mtime: float
    target: str | None = None


class FileList(Answer):
    entries: list[FileEntry]


class WriteResult(Answer):
    size: int


class AuditItems(Answer):
    items: list[dict[str, Any]]


class VMUsage(Answer):
    """One sandbox in GET /usage: what it was given, and its counters (they only grow while its
    VMM lives; `vmm` changes when they start again)."""

    id: str
    state: Literal["running", "paused", "suspended"]
    vmm: int | None = None  # its VMM's pid (None: suspended)
    vmm_age_s: float | None = None  # since its VMM started: how long its counters have counted
    cpu_seconds: float = 0.0
    disk_bytes: int = 0  # allocated on the pool by its disk
    stored_bytes: int = 0  # allocated on the pool by its suspended snapshot
    net_rx_bytes: int | None = None
    net_tx_bytes: int | None = None
    # Bytes (sent, received) by host through its gateway since the gateway took it on, in the
    # run of counts `traffic_epoch` names; None: the gateway did not answer this time.
    traffic: dict[str, tuple[int, int]] | None = None
    traffic_epoch: str | None = None


class UsageReport(Answer):
    """GET /usage: every sandbox here that runs, is paused or is suspended, measured at `at`."""

    at: float
    vms: list[VMUsage]


class VMStats(Answer):
    """GET /vms/{id}/stats: what a live VM uses, measured on the host (its VMM process, its
    disk on the pool, its tap), never reported by the guest."""

    id: str
    state: VMState
    at: float  # unix time of the measurement
    vcpus: int
    memory_mib: int  # the guest RAM it was given
    cpu_seconds: float  # the VMM process's user + system time
    memory_bytes: int  # the VMM process's proportional set size
    disk_bytes: int  # allocated on the pool by its disk
    net_rx_bytes: int | None = None  # None: the VM has no NIC
    net_tx_bytes: int | None = None
