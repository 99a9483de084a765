"""CONTRACT-TEST STAND-IN FOR FIRECRACKER. THIS IS NOT FIRECRACKER.

Firecracker cannot run on our machines (no binary, no working KVM), so the driver is tested
against Firecracker's *published API contract* instead: this script serves HTTP on the
`--api-sock` path like Firecracker does, and checks every request against the real OpenAPI
spec (`firecracker-api-v1.16.1.yaml`): the path template and method must exist, and the body
must validate (JSON Schema Draft 4, `#/definitions/...` refs resolved from the spec). A request
the spec does not allow is answered 400 with a `fault_message` and recorded as a violation.

It also keeps just enough state to apply the rules Firecracker documents (pre-boot-only and
post-boot-only operations, snapshots only when paused, snapshot load only on a fresh process,
files that must exist) and to answer `GET /`. It writes snapshot files, serves the hybrid
vsock handshake (`CONNECT 1024\\n` -> `OK 1073741824\\n`, then echoes) on the vsock `uds_path`,
and exits on `SendCtrlAltDel` as Firecracker does when the guest reboots (`reboot=k`).
No guest runs: nothing here says anything about Firecracker's behaviour beyond its contract.

Every request is appended as a JSON line to the file named by $FAKE_FIRECRACKER_LOG.

Run as `fake_firecracker.py --as-jailer ...` it stands in for the `jailer`: it checks the
jailer's arguments, lays out the chroot directory as the jailer does and execs the fake
Firecracker in it. It does not chroot or change uid (there is no Python inside the jail); it
tells the fake where the jail root is instead, and the fake resolves paths against it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import resource
import shutil
import signal
import stat
import sys
from pathlib import Path
from typing import Any

import jsonschema
import yaml

SPEC_ENV = "SPACE_FIRECRACKER_SPEC"
LOG_ENV = "FAKE_FIRECRACKER_LOG"
JAIL_ROOT_ENV = "FAKE_FIRECRACKER_JAIL_ROOT"
IGNORE_CTRL_ALT_DEL_ENV = "FAKE_FIRECRACKER_IGNORE_CTRL_ALT_DEL"
SPEC_NAME = "firecracker-api-v1.16.1.yaml"

AGENT_PORT = 1024
VSOCK_OK = b"OK 1073741824\n"
FAKE_VERSION = "1.16.1"
SNAPSHOT_MAGIC = "space-contract-fake-snapshot"


def spec_path() -> Path:
    """The spec: $SPACE_FIRECRACKER_SPEC, else `shared/reference/` beside the repository."""
    override = os.environ.get(SPEC_ENV)
    if override:
        return Path(override)
    return Path(__file__).resolve().parents[3] / "shared" / "reference" / SPEC_NAME


class SpecMissingError(RuntimeError):
    pass


# --- the validator ---------------------------------------------------------------------------


def _strict(schema: Any) -> Any:
    """Forbid unknown fields in every object schema that lists its properties.

    The spec leaves `additionalProperties` open, but Firecracker deserializes every body with
    serde's `deny_unknown_fields` and answers 400 to a misspelt field; so must we.
    """
    if isinstance(schema, dict):
        out = {key: _strict(value) for key, value in schema.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    return schema


class Spec:
    """Firecracker's Swagger 2.0 document, as a request validator."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or spec_path()
        if not self.path.is_file():
            raise SpecMissingError(
                f"Firecracker API spec not found at {self.path}. The Firecracker contract tests "
                f"need it: put {SPEC_NAME} in shared/reference/ beside the repository, or point "
                f"${SPEC_ENV} at it."
            )
        self.doc: dict[str, Any] = yaml.safe_load(self.path.read_text())
        if self.doc.get("swagger") != "2.0" or "paths" not in self.doc:
            raise SpecMissingError(f"{self.path} is not a Swagger 2.0 document")
        self.definitions = _strict(self.doc.get("definitions", {}))
        self._routes: list[tuple[re.Pattern[str], str]] = []
        for template in self.doc["paths"]:
            pattern = re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>[^/]+)", re.escape(template))
            self._routes.append((re.compile(f"^{pattern}$"), template))

    @property
    def version(self) -> str:
        return str(self.doc["info"]["version"])

    def operations(self) -> set[tuple[str, str]]:
        return {
            (method.upper(), template)
            for template, item in self.doc["paths"].items()
            for method in item
            if method in ("get", "put", "patch", "post", "delete")
        }

    def operation(self, method: str, template: str) -> dict[str, Any] | None:
        item = self.doc["paths"].get(template, {})
        found = item.get(method.lower())
        return found if isinstance(found, dict) else None

    def route(self, raw_path: str) -> tuple[str, dict[str, str]] | None:
        path = raw_path.split("?", 1)[0]
        for pattern, template in self._routes:
            match = pattern.match(path)
            if match:
                return template, match.groupdict()
        return None

    def _validator(self, schema: dict[str, Any]) -> jsonschema.Draft4Validator:
        # `#/definitions/X` resolves against the document's root: give it the spec's definitions.
        root = {"allOf": [_strict(schema)], "definitions": self.definitions}
        return jsonschema.Draft4Validator(root)

    def check_request(self, method: str, raw_path: str, body: bytes) -> list[str]:
        """Everything the spec (and Firecracker's parser) finds wrong with this request."""
        routed = self.route(raw_path)
        if routed is None:
            return [f"path {raw_path!r} is not in the Firecracker API"]
        template, params = routed
        operation = self.operation(method, template)
        if operation is None:
            allowed = sorted(m.upper() for m in self.doc["paths"][template])
            return [f"{method} is not allowed on {template} (the spec has {', '.join(allowed)})"]
        body_params = [p for p in operation.get("parameters", []) if p.get("in") == "body"]
        if not body_params:
            return [f"{method} {template} takes no body"] if body.strip() else []
        param = body_params[0]
        if not body.strip():
            # Firecracker's parser refuses any empty PUT, and empty PATCHes except on /balloon*.
            if param.get("required") or method == "PUT" or not template.startswith("/balloon"):
                return [f"{method} {template} needs a JSON body"]
            return []
        try:
            document = json.loads(body)
        except ValueError as exc:
            return [f"body is not JSON: {exc}"]
        problems = [
            f"body{_where(error.absolute_path)}: {error.message}"
            for error in sorted(
                self._validator(param["schema"]).iter_errors(document), key=lambda e: e.path
            )
        ]
        problems += _parser_rules(template, params, document)
        return problems

    def check_response(self, method: str, template: str, status: int, payload: Any) -> list[str]:
        """Our own answers must match the spec too, or the client is tested against fiction."""
        operation = self.operation(method, template) or {}
        responses = operation.get("responses", {})
        declared = responses.get(status) or responses.get(str(status)) or responses.get("default")
        if declared is None:
            return [f"status {status} is not declared for {method} {template}"]
        schema = declared.get("schema")
        if schema is None or payload is None:
            return []
        return [e.message for e in self._validator(schema).iter_errors(payload)]


def _where(path: Any) -> str:
    parts = list(path)
    return "" if not parts else "." + ".".join(str(p) for p in parts)


def _parser_rules(template: str, params: dict[str, str], body: Any) -> list[str]:
    """Rules the spec states in prose (or Firecracker's parser enforces) beyond the schema."""
    problems = []
    for name, value in params.items():
        # Firecracker's `checked_id`: the id comes from the URL path as-is.
        if not re.fullmatch(r"\w+", value):
            problems.append(
                f"API Resource IDs can only contain alphanumeric characters and underscores "
                f"(got {value!r})"
            )
        if isinstance(body, dict) and body.get(name) != value:
            problems.append(
                f"the id in the path ({value!r}) does not match the body's {name} "
                f"({body.get(name)!r})"
            )
    if template == "/snapshot/load" and isinstance(body, dict):
        # "Exactly one of the two `mem_*` fields must be present in the body of the request."
        present = [key for key in ("mem_backend", "mem_file_path") if key in body]
        if len(present) != 1:
            problems.append(
                "exactly one of mem_backend and mem_file_path must be present "
                f"(found {present or 'neither'})"
            )
    return problems


# --- the stand-in server ---------------------------------------------------------------------

PRE_BOOT_ONLY = {
    ("PUT", "/machine-config"),
    ("PATCH", "/machine-config"),
    ("PUT", "/boot-source"),
    ("PUT", "/cpu-config"),
    ("PUT", "/drives/{drive_id}"),
    ("PUT", "/pmem/{id}"),
    ("PUT", "/network-interfaces/{iface_id}"),
    ("PUT", "/vsock"),
    ("PUT", "/entropy"),
    ("PUT", "/balloon"),
    ("PUT", "/mmds/config"),
    ("PUT", "/serial"),
    ("PUT", "/hotplug/memory"),
    ("PUT", "/logger"),
    ("PUT", "/metrics"),
    ("PUT", "/snapshot/load"),
}
POST_BOOT_ONLY = {
    ("PATCH", "/drives/{drive_id}"),
    ("PATCH", "/pmem/{id}"),
    ("PATCH", "/network-interfaces/{iface_id}"),
    ("PATCH", "/vm"),
    ("PUT", "/snapshot/create"),
    ("PATCH", "/hotplug/memory"),
    ("PATCH", "/balloon/hinting/start"),
    ("PATCH", "/balloon/hinting/stop"),
}
SINGLETONS = {  # PUT path -> key in GET /vm/config
    "/machine-config": "machine-config",
    "/boot-source": "boot-source",
    "/cpu-config": "cpu-config",
    "/vsock": "vsock",
    "/entropy": "entropy",
    "/balloon": "balloon",
    "/mmds/config": "mmds-config",
    "/logger": "logger",
    "/metrics": "metrics",
    "/hotplug/memory": "memory-hotplug",
}


class Refused(Exception):
    """A spec-valid request that Firecracker would still refuse (state, missing file, …)."""


class FakeFirecracker:
    def __init__(self, spec: Spec, api_sock: str, instance_id: str, jail_root: Path | None):
        self.spec = spec
        self.api_sock = api_sock
        self.instance_id = instance_id
        self.jail_root = jail_root
        self.log_path = os.environ.get(LOG_ENV)
        self.state = "Not started"
        self.config: dict[str, Any] = {}
        self.drives: dict[str, dict[str, Any]] = {}
        self.ifaces: dict[str, dict[str, Any]] = {}
        self.pmem: dict[str, dict[str, Any]] = {}
        self.mmds: dict[str, Any] = {}
        self.serial: dict[str, Any] | None = None
        self.vsock_server: asyncio.AbstractServer | None = None
        self.done = asyncio.Event()
        self.exit_code = 0

    # -- helpers --------------------------------------------------------------------------------

    def resolve(self, path: str) -> Path:
        """A path as Firecracker would open it: relative to its cwd, or inside the jail.

        In the jail the cwd is the jail's root, so `/x` becomes `x`: as short as inside a
        real chroot (a unix socket path must fit in 107 bytes).
        """
        if self.jail_root is not None and path.startswith("/"):
            return Path(path.lstrip("/") or ".")
        return Path(path)

    def record(self, entry: dict[str, Any]) -> None:
        if not self.log_path:
            return
        entry = {"pid": os.getpid(), "id": self.instance_id, **entry}
        with open(self.log_path, "a") as log:
            log.write(json.dumps(entry) + "\n")

    def console(self, text: str) -> None:
        line = f"[space contract fake, not Firecracker] {text}\n"
        if self.serial and "serial_out_path" in self.serial:
            with open(self.resolve(self.serial["serial_out_path"]), "a") as out:
                out.write(line)
        else:
            sys.stdout.write(line)
            sys.stdout.flush()

    # -- HTTP -----------------------------------------------------------------------------------

    async def serve(self) -> int:
        path = self.resolve(self.api_sock)
        if path.exists():
            # Firecracker cannot bind over an existing socket path either.
            print(f"Failed to open the API socket at {path}: Address in use", file=sys.stderr)
            return 1
        server = await asyncio.start_unix_server(self.connection, path=str(path))
        async with server:
            await self.done.wait()
        if self.vsock_server is not None:
            self.vsock_server.close()
        return self.exit_code

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    break
                method, target, _ = line.decode("latin-1").rstrip("\r\n").split(" ", 2)
                headers: dict[str, str] = {}
                while True:
                    header = await reader.readline()
                    if header in (b"\r\n", b"\n", b""):
                        break
                    key, _, value = header.decode("latin-1").partition(":")
                    headers[key.strip().lower()] = value.strip()
                if "chunked" in headers.get("transfer-encoding", ""):
                    raise ValueError("chunked bodies are not supported by Firecracker's server")
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                status, payload = await self.handle(method, target, body)
                writer.write(_http_response(status, payload))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def handle(self, method: str, target: str, body: bytes) -> tuple[int, Any]:
        entry: dict[str, Any] = {"method": method, "path": target}
        try:
            entry["body"] = json.loads(body) if body.strip() else None
        except ValueError:
            entry["body"] = body.decode("latin-1")
        problems = self.spec.check_request(method, target, body)
        routed = self.spec.route(target)
        entry["template"] = routed[0] if routed else None
        if problems:
            status, payload = 400, {"fault_message": "; ".join(problems)}
            entry["problem"] = {"kind": "spec", "message": "; ".join(problems)}
        else:
            assert routed is not None
            try:
                payload = await self.apply(method, routed[0], routed[1], entry["body"])
                status = 204 if payload is None else 200
            except Refused as exc:
                status, payload = 400, {"fault_message": str(exc)}
                entry["problem"] = {"kind": "state", "message": str(exc)}
            fake_bugs = self.spec.check_response(method, routed[0], status, payload)
            if fake_bugs:
                entry["problem"] = {"kind": "fake", "message": "; ".join(fake_bugs)}
        entry["status"] = status
        self.record(entry)
        return status, payload

    # -- Firecracker's rules, as far as the contract states them --------------------------------

    async def apply(self, method: str, template: str, params: dict[str, str], body: Any) -> Any:
        key = (method, template)
        started = self.state != "Not started"
        if key in PRE_BOOT_ONLY and started:
            raise Refused("The requested operation is not supported after starting the microVM.")
        if key in POST_BOOT_ONLY and not started:
            raise Refused("The requested operation is not supported before starting the microVM.")

        if method == "GET":
            return self.get(template)
        if template == "/actions":
            return await self.action(body["action_type"])
        if template == "/vm":
            self.state = "Paused" if body["state"] == "Paused" else "Running"
            return None
        if template == "/snapshot/create":
            return self.create_snapshot(body)
        if template == "/snapshot/load":
            return await self.load_snapshot(body)
        if template == "/drives/{drive_id}":
            return self.put_or_patch(self.drives, params["drive_id"], method, body)
        if template == "/network-interfaces/{iface_id}":
            return self.put_or_patch(self.ifaces, params["iface_id"], method, body)
        if template == "/pmem/{id}":
            return self.put_or_patch(self.pmem, params["id"], method, body)
        if template == "/mmds":
            self.mmds = body if method == "PUT" else {**self.mmds, **body}
            return None
        if template == "/serial":
            self.serial = body
            return None
        if template in ("/logger", "/metrics"):
            field = "log_path" if template == "/logger" else "metrics_path"
            if template == "/metrics" and "metrics" in self.config:
                raise Refused("Reinitialization of metrics not allowed.")
            if field in body:
                self.resolve(body[field]).open("a").close()
        if template == "/machine-config" and method == "PATCH":
            self.config["machine-config"] = {**self.get("/machine-config"), **body}
            return None
        if (template, method) in (("/balloon", "PATCH"), ("/balloon/statistics", "PATCH")):
            if "balloon" not in self.config:
                raise Refused("Balloon device not configured.")
            self.config["balloon"].update(body)
            return None
        if template.startswith("/balloon/hinting") or (method, template) == (
            "PATCH",
            "/hotplug/memory",
        ):
            raise Refused("Not supported by the contract fake (no guest).")
        if method == "PUT" and template in SINGLETONS:
            self.config[SINGLETONS[template]] = body
            return None
        raise Refused(f"{method} {template} is valid but the contract fake does not model it")

    def put_or_patch(
        self, table: dict[str, dict[str, Any]], ident: str, method: str, body: dict[str, Any]
    ) -> None:
        if method == "PUT":
            table[ident] = body
        elif ident not in table:
            raise Refused(f"Invalid device ID {ident!r}: no such device.")
        else:
            table[ident].update(body)

    def get(self, template: str) -> Any:
        if template == "/":
            return {
                "app_name": "Firecracker",
                "id": self.instance_id,
                "state": self.state,
                "vmm_version": FAKE_VERSION,
            }
        if template == "/version":
            return {"firecracker_version": FAKE_VERSION}
        if template == "/machine-config":
            return self.config.get(
                "machine-config",
                {"vcpu_count": 1, "mem_size_mib": 128, "smt": False, "track_dirty_pages": False},
            )
        if template == "/vm/config":
            full = {k: v for k, v in self.config.items() if k != "memory-hotplug"}
            full["drives"] = list(self.drives.values())
            full["network-interfaces"] = list(self.ifaces.values())
            full["pmem"] = list(self.pmem.values())
            return full
        if template == "/mmds":
            return self.mmds
        if template == "/balloon":
            if "balloon" not in self.config:
                raise Refused("Balloon device not configured.")
            return self.config["balloon"]
        if template == "/balloon/statistics":
            if not self.config.get("balloon", {}).get("stats_polling_interval_s"):
                raise Refused("Statistics for the balloon device are not enabled")
            mib = self.config["balloon"]["amount_mib"]
            return {
                "target_pages": mib * 256,
                "actual_pages": 0,
                "target_mib": mib,
                "actual_mib": 0,
            }
        if template == "/hotplug/memory":
            if "memory-hotplug" not in self.config:
                raise Refused("Memory hotplug is not configured.")
            return {**self.config["memory-hotplug"], "plugged_size_mib": 0}
        raise Refused("Not supported by the contract fake (no guest).")

    async def action(self, action: str) -> None:
        if action == "InstanceStart":
            if self.state != "Not started":
                raise Refused("The microVM is already running.")
            boot = self.config.get("boot-source")
            if boot is None:
                raise Refused("Cannot start microvm without kernel configuration.")
            self.require_file(boot["kernel_image_path"], "kernel")
            if "initrd_path" in boot:
                self.require_file(boot["initrd_path"], "initrd")
            for drive in self.drives.values():
                if "path_on_host" in drive:
                    self.require_file(drive["path_on_host"], f"drive {drive['drive_id']}")
            await self.start_vsock()
            self.state = "Running"
            self.console(f"InstanceStart: boot_args={boot.get('boot_args', '')!r}")
            return None
        if action == "SendCtrlAltDel":
            if self.state == "Not started":
                raise Refused("The requested operation is not supported before starting.")
            if not os.environ.get(IGNORE_CTRL_ALT_DEL_ENV):
                # The guest reboots (reboot=k), and a guest reboot ends Firecracker.
                asyncio.get_running_loop().call_later(0.05, self.done.set)
            return None
        if action == "FlushMetrics":
            if "metrics" not in self.config:
                raise Refused("The metrics system is not initialized.")
            with open(self.resolve(self.config["metrics"]["metrics_path"]), "a") as out:
                out.write(json.dumps({"contract_fake": True}) + "\n")
            return None
        raise Refused(f"unknown action {action}")

    def require_file(self, path: str, what: str) -> None:
        if not self.resolve(path).is_file():
            raise Refused(f"Cannot open the {what} file {path!r}: No such file or directory")

    def create_snapshot(self, body: dict[str, Any]) -> None:
        if self.state != "Paused":
            raise Refused("Cannot create a snapshot: the microVM must be paused first.")
        machine = self.config.get("machine-config", {"vcpu_count": 1, "mem_size_mib": 128})
        state = {
            "magic": SNAPSHOT_MAGIC,
            "machine-config": machine,
            "drives": list(self.drives.values()),
            "network-interfaces": list(self.ifaces.values()),
            "vsock": self.config.get("vsock"),
        }
        self.resolve(body["snapshot_path"]).write_text(json.dumps(state))
        with open(self.resolve(body["mem_file_path"]), "wb") as memory:
            memory.write(b"contract fake guest memory")
            memory.truncate(machine["mem_size_mib"] << 20)  # sparse, like an idle guest's
        return None

    async def load_snapshot(self, body: dict[str, Any]) -> None:
        others = set(self.config) - {"logger", "metrics"}
        if others or self.drives or self.ifaces:
            raise Refused(
                "Loading a microVM snapshot not allowed after configuring boot-specific resources."
            )
        backend = body.get("mem_backend") or {
            "backend_type": "File",
            "backend_path": body["mem_file_path"],
        }
        if backend["backend_type"] != "File":
            raise Refused("the contract fake serves only File memory backends")
        self.require_file(backend["backend_path"], "guest memory")
        self.require_file(body["snapshot_path"], "snapshot state")
        state = json.loads(self.resolve(body["snapshot_path"]).read_text())
        if state.get("magic") != SNAPSHOT_MAGIC:
            raise Refused("Cannot deserialize the microVM state: not a snapshot")
        # Firecracker reopens the disks at the paths recorded in the snapshot.
        for drive in state["drives"]:
            if "path_on_host" in drive:
                self.require_file(drive["path_on_host"], f"drive {drive['drive_id']}")
        ifaces = {i["iface_id"]: i for i in state["network-interfaces"]}
        for override in body.get("network_overrides", []):
            if override["iface_id"] not in ifaces:
                raise Refused(f"Invalid network override: no interface {override['iface_id']!r}")
            ifaces[override["iface_id"]]["host_dev_name"] = override["host_dev_name"]
        vsock = state.get("vsock")
        if "vsock_override" in body:
            if vsock is None:
                raise Refused("Cannot override the vsock device: the snapshot has none.")
            vsock = {**vsock, "uds_path": body["vsock_override"]["uds_path"]}
        self.config["machine-config"] = state["machine-config"]
        self.drives = {d["drive_id"]: d for d in state["drives"]}
        self.ifaces = ifaces
        if vsock is not None:
            self.config["vsock"] = vsock
        await self.start_vsock()
        self.state = "Running" if body.get("resume_vm") else "Paused"
        self.console(f"snapshot loaded, state {self.state}")
        return None

    # -- hybrid vsock ---------------------------------------------------------------------------

    async def start_vsock(self) -> None:
        vsock = self.config.get("vsock")
        if vsock is None:
            return
        path = self.resolve(vsock["uds_path"])
        if path.exists():
            raise Refused(f"Cannot create the vsock backend {path}: Address in use")
        self.vsock_server = await asyncio.start_unix_server(self.vsock_peer, path=str(path))

    async def vsock_peer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A guest with an echoing agent on port 1024 and nothing on any other port."""
        try:
            line = await reader.readline()
            self.record({"event": "vsock", "line": line.decode("latin-1")})
            if line != f"CONNECT {AGENT_PORT}\n".encode() or self.state != "Running":
                return  # Firecracker closes the connection when the guest does not accept
            writer.write(VSOCK_OK)
            await writer.drain()
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()


def _http_response(status: int, payload: Any) -> bytes:
    reasons = {200: "OK", 204: "No Content", 400: "Bad Request", 500: "Internal Server Error"}
    head = f"HTTP/1.1 {status} {reasons.get(status, 'Unknown')}\r\nServer: Firecracker API\r\n"
    if payload is None:
        return (head + "\r\n").encode()
    data = json.dumps(payload).encode()
    head += f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    return head.encode() + data


# --- command lines ---------------------------------------------------------------------------


def firecracker_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="firecracker (contract fake)")
    for flag in (
        "--api-sock",
        "--id",
        "--start-time-us",
        "--start-time-cpu-us",
        "--parent-cpu-time-us",
        "--seccomp-filter",
        "--config-file",
        "--log-path",
        "--level",
        "--module",
        "--metrics-path",
        "--http-api-max-payload-size",
        "--mmds-size-limit",
    ):
        parser.add_argument(flag)
    for flag in ("--no-seccomp", "--boot-timer", "--show-level", "--show-log-origin"):
        parser.add_argument(flag, action="store_true")
    args = parser.parse_args(argv)
    jail_root = os.environ.get(JAIL_ROOT_ENV)
    try:
        spec = Spec()
    except SpecMissingError as exc:
        print(exc, file=sys.stderr)
        return 3
    instance_id = args.id or "anonymous-instance"
    if not re.fullmatch(r"[A-Za-z0-9-]{1,64}", instance_id):
        print(f"Invalid instance ID: {instance_id!r}", file=sys.stderr)
        return 1
    fake = FakeFirecracker(
        spec,
        args.api_sock or "/run/firecracker.socket",
        instance_id,
        Path(jail_root) if jail_root else None,
    )
    fake.record({"event": "start", "argv": sys.argv[1:], "cwd": os.getcwd(), "sid": os.getsid(0)})
    return asyncio.run(fake.serve())


def jailer_main(argv: list[str]) -> int:
    """Checks the jailer's arguments and lays out the jail as the jailer does, then execs."""
    split = argv.index("--") if "--" in argv else len(argv)
    own, extra = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(prog="jailer (contract fake)")
    for flag in ("--id", "--exec-file", "--uid", "--gid"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--chroot-base-dir", default="/srv/jailer")
    parser.add_argument("--netns")
    parser.add_argument("--cgroup", action="append", default=[])
    parser.add_argument("--resource-limit", action="append", default=[])
    parser.add_argument("--cgroup-version", default="1")
    parser.add_argument("--parent-cgroup")
    parser.add_argument("--daemonize", action="store_true")
    parser.add_argument("--new-pid-ns", action="store_true")
    args = parser.parse_args(own)
    log_path = os.environ.get(LOG_ENV)

    def fail(message: str) -> int:
        print(message, file=sys.stderr)
        return 1

    if log_path:
        # The namespace it would enter, by inode: what the caller's path named at this moment.
        netns = os.stat(args.netns).st_ino if args.netns and Path(args.netns).exists() else None
        record = {"event": "jailer", "pid": os.getpid(), "argv": argv, "netns_ino": netns}
        with open(log_path, "a") as log:
            log.write(json.dumps(record) + "\n")
    if not re.fullmatch(r"[A-Za-z0-9-]{1,64}", args.id):
        return fail(f"Invalid instance ID: {args.id!r}")
    exec_file = Path(args.exec_file).resolve()
    if not exec_file.is_file():
        return fail(f"{exec_file} is not a file")
    if "firecracker" not in exec_file.name:
        return fail(f'The filename of `--exec-file` option must contain "firecracker": {exec_file}')
    if not (args.uid.isdigit() and args.gid.isdigit()):
        return fail(f"Invalid uid/gid: {args.uid}/{args.gid}")
    if args.cgroup_version not in ("1", "2"):
        return fail(f"{args.cgroup_version} is an invalid cgroup version specifier")
    for cgroup in args.cgroup:
        parts = cgroup.split("=")
        if len(parts) != 2 or not parts[1]:
            return fail(f"Invalid format for cgroups: {cgroup}")
    limits = {"fsize": resource.RLIMIT_FSIZE, "no-file": resource.RLIMIT_NOFILE}
    for limit in args.resource_limit:
        name, _, value = limit.partition("=")
        if name not in limits or not value.isdigit():
            return fail(f"Invalid resource argument: {limit}")
    if args.netns and not Path(args.netns).exists():
        return fail(f"Failed to open file {args.netns}")
    base = Path(args.chroot_base_dir).resolve()
    if not base.is_dir():
        return fail(f"{base} is not a directory")
    root = base / exec_file.name / args.id / "root"
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy2(exec_file, root / exec_file.name)
    for folder in ("run", "dev/net"):
        (root / folder).mkdir(parents=True, exist_ok=True, mode=0o700)
    if os.geteuid() == 0:
        for node, (major, minor) in {"dev/kvm": (10, 232), "dev/net/tun": (10, 200)}.items():
            try:
                os.mknod(root / node, stat.S_IFCHR | 0o600, os.makedev(major, minor))
            except FileExistsError:
                return fail(f"Failed to create /{node} via mknod inside the jail: File exists")
    for limit in args.resource_limit:
        name, _, value = limit.partition("=")
        resource.setrlimit(limits[name], (int(value), int(value)))
    if args.daemonize:
        try:
            os.setsid()
        except OSError as exc:
            return fail(f"Failed to daemonize: setsid: {exc}")
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.close(null)
    # The jailer clears the environment; the fake keeps only what it needs to run and report.
    env = {JAIL_ROOT_ENV: str(root)}
    for name in (LOG_ENV, SPEC_ENV):
        if name in os.environ:
            env[name] = os.environ[name]
    os.chdir(root)
    target = str(root / exec_file.name)
    os.execve(
        target,
        [target, "--id", args.id, "--start-time-us", "0", "--start-time-cpu-us", "0", *extra],
        env,
    )
    return 1  # not reached


def write_launcher(path: Path, env: dict[str, str], *, jailer: bool = False) -> Path:
    """An executable that runs this fake with the test's interpreter and settings."""
    exports = "".join(f"export {name}={_sh_quote(value)}\n" for name, value in env.items())
    mode = " --as-jailer" if jailer else ""
    path.write_text(
        "#!/bin/sh\n"
        "# Contract-test stand-in: NOT Firecracker. See tests/contract/fake_firecracker.py.\n"
        f"{exports}exec {_sh_quote(sys.executable)} {_sh_quote(str(Path(__file__).resolve()))}"
        f'{mode} "$@"\n'
    )
    path.chmod(0o755)
    return path


def _sh_quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    argv = sys.argv[1:]
    if argv[:1] == ["--as-jailer"]:
        return jailer_main(argv[1:])
    return firecracker_main(argv)


def load_records(log_path: Path) -> list[dict[str, Any]]:
    if not log_path.exists():
        return []
    return [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
