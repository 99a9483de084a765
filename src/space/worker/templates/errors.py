"""What can go wrong making a template; every message names what was wrong and what to do."""

from __future__ import annotations


class TemplateError(Exception):
    """Base of every template error."""


class SpecError(TemplateError):
    """The template spec (space.toml) is invalid."""


class RegistryError(TemplateError):
    """The registry answered something we cannot use (or could not be reached)."""


class ImageNotFound(RegistryError):
    """The registry has no such repository, tag or digest."""


class AuthenticationFailed(RegistryError):
    """The registry refused the credentials, or needs some and none were given."""


class DigestMismatch(RegistryError):
    """Downloaded content does not hash to the digest it was asked for by."""


class ImageError(TemplateError):
    """An image (layout, archive, manifest or config) is malformed or unsupported."""


class UnsafeLayer(ImageError):
    """A layer tries to write outside the root (path traversal, links out of the root)."""


class NotBootable(TemplateError):
    """The root file system lacks what the SPACE guest agent needs to boot (python3)."""


class BuildError(TemplateError):
    """A build step failed, or the build VM did."""
