"""Artifacts in the deployment's OCI registry: what lets a template, a suspended sandbox or a
volume leave the host that made it."""

from space.worker.artifacts.store import Artifacts, Pushed

__all__ = ["Artifacts", "Pushed"]
