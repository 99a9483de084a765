"""Templates: the starting file systems of sandboxes, built from what users already have.

A template is a source (an OCI image from a registry, an OCI layout or `docker save` archive, a
directory, a tarball or a Debian base) turned into an ext4 root image (`rootfs`), then changed by
build steps that run inside a real build VM, each step cached by a content hash chained over
everything before it. See `builder.build_template` for the entry point, `spec` for `space.toml`.
"""

from space.worker.templates.builder import (
    BuildEnv,
    boot_images,
    build_template,
    latest_templates,
    list_templates,
    prune_cache,
    remove_template,
    stage_template,
)
from space.worker.templates.buildlog import BuildLog
from space.worker.templates.errors import (
    AuthenticationFailed,
    BuildError,
    ImageNotFound,
    RegistryError,
    SpecError,
    TemplateError,
    UnsafeLayer,
)
from space.worker.templates.record import TemplateRecord
from space.worker.templates.spec import TemplateSpec, load_spec, parse_spec

__all__ = [
    "AuthenticationFailed",
    "BuildEnv",
    "BuildError",
    "BuildLog",
    "ImageNotFound",
    "RegistryError",
    "SpecError",
    "TemplateError",
    "TemplateRecord",
    "TemplateSpec",
    "UnsafeLayer",
    "boot_images",
    "build_template",
    "latest_templates",
    "list_templates",
    "load_spec",
    "parse_spec",
    "prune_cache",
    "remove_template",
    "stage_template",
]
