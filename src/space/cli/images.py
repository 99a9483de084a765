"""`space image ...`: build the guest kernel + initramfs and SPACE's own images on this host.

Both builds are cached under the cache directory (SPACE_CACHE_DIR); running a command again is a
cache hit unless --force is given. The builders' log streams to the terminal as it comes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from space.worker.images import code_interpreter
from space.worker.images.base import BASE, Flavor, ensure_image
from space.worker.images.debs import ImageBuildError
from space.worker.images.kernel import ensure_kernel

_console = Console(highlight=False)


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _allocated(path: Path) -> int:
    return path.stat().st_blocks * 512


@contextlib.contextmanager
def _streamer(what: str, started: float) -> Iterator[Callable[[str], None]]:
    """A log callback that prints each line, under a spinner showing the latest one."""
    with _console.status(what) as status:

        def log(line: str) -> None:
            _console.print(f"[dim]{time.monotonic() - started:6.1f}s[/dim] {escape(line)}")
            status.update(f"{what}: {escape(line[:70])}")

        yield log


def _summary(title: str, rows: list[tuple[str, str]], took: float) -> None:
    table = Table(title=title, show_header=False, title_justify="left", box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for k, v in rows:
        table.add_row(k, v)
    table.add_row("time", f"{took:.2f} s")
    _console.print(table)


@click.group()
def image() -> None:
    """Build the guest kernel and template images (cached; --force rebuilds)."""


@image.command("kernel")
@click.option("--force", is_flag=True, help="Rebuild even if a cached build matches.")
def kernel_cmd(force: bool) -> None:
    """Build the guest kernel (vmlinux) and initramfs with the guest agent."""
    started = time.monotonic()
    try:
        with _streamer("building the guest kernel", started) as log:
            k = ensure_kernel(log=log, force=force)
    except ImageBuildError as e:
        raise click.ClickException(str(e)) from None
    _summary(
        "guest kernel",
        [
            ("release", k.version),
            ("key", k.key),
            ("vmlinux", f"{k.vmlinux}  ({_human(k.vmlinux.stat().st_size)})"),
            ("initrd", f"{k.initrd}  ({_human(k.initrd.stat().st_size)})"),
            ("modules", " ".join(k.modules)),
        ],
        time.monotonic() - started,
    )


@image.command("base")
@click.option("--force", is_flag=True, help="Rebuild (and re-run mmdebstrap) even if cached.")
def base_cmd(force: bool) -> None:
    """Build the `base` template: Debian bookworm minbase + python3 as an ext4 image."""
    _build(BASE, force)


@image.command("code-interpreter")
@click.option("--force", is_flag=True, help="Rebuild (and re-run mmdebstrap) even if cached.")
def code_interpreter_cmd(force: bool) -> None:
    """Build the `code-interpreter` image: `base` with Jupyter's kernel, numpy, matplotlib and
    SPACE's code interpreter service. `space up` then makes the template of it (by hand:
    `space template build -f src/space/interpreter/space.toml`)."""
    _build(code_interpreter.FLAVOR, force)


def _build(flavor: Flavor, force: bool) -> None:
    started = time.monotonic()
    try:
        with _streamer(f"building template {flavor.name}", started) as log:
            t = ensure_image(flavor, log=log, force=force)
    except ImageBuildError as e:
        raise click.ClickException(str(e)) from None
    _summary(
        f"template {flavor.name}",
        [
            ("key", t.key),
            ("rootfs", str(t.rootfs)),
            ("size", f"{_human(t.size_bytes)} (sparse; {_human(_allocated(t.rootfs))} allocated)"),
        ],
        time.monotonic() - started,
    )
