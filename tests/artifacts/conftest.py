"""The real registries of tests/templates (Debian's docker-registry: open, htpasswd, token)."""

from tests.templates.conftest import private_registry, registry, token_registry

__all__ = ["private_registry", "registry", "token_registry"]
