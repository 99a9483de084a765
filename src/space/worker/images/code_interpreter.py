"""The `code-interpreter` image: `base` with Jupyter's kernel, numpy, pandas and matplotlib from
Debian, and SPACE's code interpreter service (`space.interpreter`) under /opt/space, which the
template's spec (`space.interpreter` package data, `space.toml`) starts in every sandbox."""

from __future__ import annotations

from pathlib import Path

import space.interpreter
from space.worker.images.base import INCLUDE, Flavor

NAME = "code-interpreter"
PACKAGES = ("python3-ipykernel", "python3-jupyter-client", "python3-tornado",
            "python3-matplotlib", "python3-numpy", "python3-pandas")  # fmt: skip
HOME = "/opt/space"  # on the image's python path through the spec's PYTHONPATH


def service_files() -> dict[str, bytes]:
    """The service's modules, as a package `space.interpreter` of its own under /opt/space."""
    package = Path(space.interpreter.__file__).parent
    files = {f"{HOME}/space/__init__.py": b""}
    for module in sorted(package.glob("*.py")):
        files[f"{HOME}/space/interpreter/{module.name}"] = module.read_bytes()
    return files


FLAVOR = Flavor(NAME, INCLUDE + PACKAGES, service_files, size_bytes=2 << 30, recommends=False)
