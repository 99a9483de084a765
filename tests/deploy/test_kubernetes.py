"""The Kubernetes manifests, rendered by the pinned kubectl's kustomize and checked offline:
every object against the Kubernetes schemas of pinned versions (and the CRD schema of the
operator it belongs to), the references between objects, and the settings: every one the
services read is set (or left at its default on purpose), every one set is read."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import pytest
from starlette.routing import Match

from space.api.app import create_app
from space.cli.admin import admin
from space.settings import Settings
from tests.deploy import kube
from tests.deploy.kube import Obj

OVERLAYS = ("base", "overlays/kind", "overlays/production")
DOC = kube.ROOT / "docs" / "deploy-kubernetes.md"


@cache
def _rendered(overlay: str) -> tuple[Obj, ...]:
    return tuple(kube.render(overlay))


def rendered(overlay: str) -> list[Obj]:
    return list(_rendered(overlay))


def find(objects: list[Obj], kind: str, name: str) -> Obj:
    return next(o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_matches_its_schema(overlay: str) -> None:
    assert kube.schema_problems(rendered(overlay)) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_references_between_objects_resolve(overlay: str) -> None:
    assert kube.reference_problems(rendered(overlay)) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_settings_read_are_set_and_settings_set_are_read(overlay: str) -> None:
    assert kube.settings_problems(rendered(overlay)) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_keep_their_state_on_the_node_and_sign_with_the_deployments_ca(
    overlay: str,
) -> None:
    assert kube.worker_problems(rendered(overlay)) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_and_control_plane_speak_mutual_tls(overlay: str) -> None:
    assert kube.identity_problems(rendered(overlay)) == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_secrets_the_pods_read_are_the_ones_the_guide_says_to_create(overlay: str) -> None:
    guide = kube.words(DOC.read_text())
    for secret, keys in kube.secrets_used(rendered(overlay)).items():
        missing = ({secret} | keys) - guide
        assert not missing, f"docs/deploy-kubernetes.md never names {missing} (Secret {secret})"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_replicas_probes_and_migrations(overlay: str) -> None:
    objects = rendered(overlay)
    api = find(objects, "Deployment", "space-api")
    assert api["spec"]["replicas"] >= 2
    pod = api["spec"]["template"]["spec"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert served_by_the_api(pod["containers"][0][probe]["httpGet"]["path"])
    # Each rollout migrates first, with the project's own command.
    migrate = pod["initContainers"][0]
    assert migrate["args"] == ["admin", "migrate"] and "migrate" in admin.commands
    assert find(objects, "Deployment", "space-controller")["spec"]["replicas"] == 2
    worker = find(objects, "DaemonSet", "space-worker")["spec"]["template"]["spec"]
    assert worker["nodeSelector"] == {"space-worker": "true"}


def served_by_the_api(path: str) -> bool:
    app = create_app(Settings(), "postgresql+asyncpg://unused/unused")
    scope = {"type": "http", "method": "GET", "path": path, "root_path": "", "headers": []}
    return any(route.matches(scope)[0] == Match.FULL for route in app.router.routes)


def test_a_probe_on_a_path_the_api_does_not_serve_would_fail() -> None:
    assert served_by_the_api("/healthz") and not served_by_the_api("/readyz")


def _env(obj: Obj, container: int = 0) -> list[Obj]:
    env: list[Obj] = obj["spec"]["template"]["spec"]["containers"][container]["env"]
    return env


def _drop_env(var: str) -> Callable[[Obj], None]:
    return lambda o: _env(o).remove(next(e for e in _env(o) if e["name"] == var))


def _volume(volume: str, source: Obj) -> Callable[[Obj], None]:
    def change(obj: Obj) -> None:
        volumes = obj["spec"]["template"]["spec"]["volumes"]
        i = next(i for i, v in enumerate(volumes) if v["name"] == volume)
        volumes[i] = {"name": volume, **source}

    return change


def _set(path: list[Any], value: Any) -> Callable[[Obj], None]:
    def change(obj: Obj) -> None:
        for key in path[:-1]:
            obj = obj[key]
        obj[path[-1]] = value

    return change


MUTATIONS: dict[str, tuple[str, Callable[[Obj], None], Callable[[list[Obj]], list[str]]]] = {
    "a setting no manifest sets": (
        "ConfigMap", lambda o: o["data"].pop("SPACE_LEASE_TTL"), kube.settings_problems),
    "a misspelt setting": (
        "ConfigMap", _set(["data", "SPACE_LEASE_TTLS"], "10"), kube.settings_problems),
    "a worker without the worker secret": (
        "DaemonSet", _drop_env("SPACE_WORKER_SECRET"), kube.settings_problems),
    "a controller without the secrets key the API has": (
        "Deployment/space-controller", _drop_env("SPACE_SECRETS_KEYS"), kube.settings_problems),
    "the database's address on a worker": (
        "DaemonSet", lambda o: _env(o).append({"name": "SPACE_DATABASE_URL", "valueFrom": {
            "secretKeyRef": {"name": "space-db-app", "key": "uri"}}}), kube.settings_problems),
    "the database's Secret mounted on a worker": (
        "DaemonSet", lambda o: o["spec"]["template"]["spec"]["volumes"].append(
            {"name": "db", "secret": {"secretName": "space-db-app"}}), kube.worker_problems),
    "the secrets key on a worker": (
        "DaemonSet", lambda o: _env(o).append({"name": "SPACE_SECRETS_KEYS", "value": "k"}),
        kube.settings_problems),
    "a secret written in the manifest": (
        "Deployment/space-api", lambda o: _env(o).__setitem__(0, {"name": "SPACE_DATABASE_URL",
                                                         "value": "postgresql://x"}),
        kube.settings_problems),
    "an unused variable": (
        "DaemonSet", lambda o: _env(o).append({"name": "NODE_ZONE", "value": "a"}),
        kube.settings_problems),
    "a misspelt field": (
        "Deployment", _set(["spec", "replica"], 2), kube.schema_problems),
    "a wrong type": (
        "DaemonSet", _set(["spec", "template", "spec", "hostNetwork"], "yes"),
        kube.schema_problems),
    "a misspelt field of the database cluster": (
        "Cluster", _set(["spec", "instance"], 3), kube.schema_problems),
    "a wrong type in the database cluster": (
        "Cluster", _set(["spec", "instances"], "three"), kube.schema_problems),
    "a Service that selects nothing": (
        "Service", _set(["spec", "selector", "app.kubernetes.io/component"], "apii"),
        kube.reference_problems),
    "a probe on an undeclared port": (
        "Deployment",
        _set(["spec", "template", "spec", "containers", 0, "readinessProbe", "httpGet", "port"],
             "web"),
        kube.reference_problems),
    "a pool that dies with the pod": (
        "DaemonSet", _set(["spec", "template", "spec", "volumes", 0], {"name": "state",
                                                                        "emptyDir": {}}),
        kube.worker_problems),
    "a gateway CA that is not the deployment's": (
        "DaemonSet", _volume("ca", {"emptyDir": {}}), kube.worker_problems),
    "the worker CA on a worker": (
        "DaemonSet", _volume("ca", {"secret": {"secretName": "space-worker-ca"}}),
        kube.identity_problems),
    "a controller without the worker CA": (
        "Deployment/space-controller", _volume("worker-ca", {"emptyDir": {}}),
        kube.identity_problems),
    "a worker that joins nowhere": (
        "DaemonSet", _drop_env("SPACE_CONTROL_URL"), kube.identity_problems),
    "a worker in plain HTTP": (
        "DaemonSet", lambda o: _env(o).append({"name": "SPACE_WORKER_TLS", "value": "0"}),
        kube.identity_problems),
}  # fmt: skip


@pytest.mark.parametrize("fault", MUTATIONS)
def test_each_check_finds_a_planted_fault(fault: str) -> None:
    target, change, check = MUTATIONS[fault]
    objects = rendered("overlays/production")
    assert check(objects) == []
    assert check(kube.mutated(objects, target, change)) != []
