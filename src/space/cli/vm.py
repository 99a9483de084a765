"""`space vm`: boot, inspect and drive single microVMs on this host by hand (a debug tool).

VMs started here keep running after the command returns; later commands find them by id in
the worker's pool and talk to their VMM and agent directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import shutil
import signal
import sys
import termios
import tty
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import click

from space.cli.output import json_option, print_json
from space.settings import Settings
from space.worker.agent_client import AgentClient, AgentError
from space.worker.local import LocalRuntime, local_runtime
from space.worker.machine import Machine
from space.worker.storage.pool import ensure_pool
from space.worker.vmm.base import SnapshotInfo, VMMError
from space.worker.vmm.qemu import VM_FILE, QemuDriver, QemuVM

P = ParamSpec("P")
R = TypeVar("R")


def run_async(fn: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, R]:
    """A click command body as a coroutine; our errors become one clear line, not a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return asyncio.run(fn(*args, **kwargs))
        except (AgentError, VMMError, OSError, ValueError) as e:
            raise click.ClickException(str(e)) from None

    return wrapper


def _progress(line: str) -> None:
    click.echo(click.style(f"  {line}", dim=True), err=True)


async def _runtime() -> LocalRuntime:
    return await local_runtime(Settings.from_env().worker, log=_progress)


async def _adopt(vm_id: str) -> QemuVM:
    """A running VM by id; needs no images, so it never builds any."""
    pool = await asyncio.to_thread(ensure_pool)
    run_dir = pool.vms / vm_id
    if not run_dir.is_dir():
        raise click.ClickException(f"no VM {vm_id!r} on this host (see: space vm ls)")
    return await QemuDriver().adopt(run_dir)


async def _with_vm(vm_id: str, action: Callable[[Any, AgentClient], Awaitable[R]]) -> R:
    vm = await _adopt(vm_id)
    try:
        agent = await AgentClient.connect(vm.open_agent_stream, vm.config.agent_token, 10)
    except BaseException:
        await vm.detach()
        raise
    try:
        return await action(vm, agent)
    finally:
        await agent.close()
        await vm.detach()


@click.group()
def vm() -> None:
    """Boot and drive single microVMs on this host (debugging)."""


@vm.command()
@click.option("--id", "vm_id", help="VM id (default: random)")
@click.option("--vcpus", default=1, show_default=True, type=click.IntRange(1, 64))
@click.option(
    "--memory", default=256, show_default=True, type=click.IntRange(64, 65536), help="MiB"
)
@click.option("--hostname")
@run_async
async def boot(vm_id: str | None, vcpus: int, memory: int, hostname: str | None) -> None:
    """Cold-boot a VM from the `base` template and wait for its agent."""
    rt = await _runtime()
    m = await Machine.boot(
        rt.driver, rt.pool, rt.images, vm_id=vm_id, vcpus=vcpus, memory_mib=memory,
        hostname=hostname,
    )  # fmt: skip
    info = await m.agent.info()
    await m.agent.close()
    await m.vm.detach()
    total = sum(m.timings.values())
    how = getattr(rt.driver, "accel", rt.driver.name)
    click.echo(f"{m.id}  booted in {total:.2f}s ({how}), kernel {info['kernel']}")
    click.echo(f"try: space vm exec {m.id} -- uname -a")


@vm.command("ls")
@json_option
@run_async
async def list_vms(as_json: bool) -> None:
    """List the VMs on this host."""
    pool = await asyncio.to_thread(ensure_pool)
    vms = []
    for run_dir in sorted(pool.vms.iterdir()):
        try:
            record = json.loads((run_dir / VM_FILE).read_text())
        except (OSError, ValueError):
            continue
        config = record["config"]
        vms.append(
            {
                "id": run_dir.name,
                "alive": Path(f"/proc/{record['pid']}").exists(),
                "pid": record["pid"],
                "vcpus": config["vcpus"],
                "memory_mib": config["memory_mib"],
                "hostname": config["hostname"],
            }
        )
    if as_json:
        print_json(vms)
        return
    for v in vms:
        click.echo(
            f"{v['id']}  {'up' if v['alive'] else 'gone':4}  pid {v['pid']:<7} "
            f"{v['vcpus']} vCPU {v['memory_mib']} MiB  {v['hostname']}"
        )


@vm.command("exec", context_settings={"ignore_unknown_options": True})
@click.argument("vm_id")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("--tty", "-t", "use_tty", is_flag=True, help="Run in a pseudo-terminal.")
@click.option("--env", "-e", multiple=True, help="KEY=VALUE")
@click.option("--cwd")
@click.option("--user", "-u")
@click.option("--timeout", type=float, help="Kill the process after this many seconds.")
def exec_(
    vm_id: str,
    command: tuple[str, ...],
    use_tty: bool,
    env: tuple[str, ...],
    cwd: str | None,
    user: str | None,
    timeout: float | None,
) -> None:
    """Run COMMAND in a VM; its output streams here and its exit code becomes ours."""
    env_map = {}
    for item in env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--env")
        env_map[key] = value

    async def action(_vm: Any, agent: AgentClient) -> int:
        if use_tty:
            return await _interactive(agent, list(command), env_map, cwd, user)
        return await _stream(agent, list(command), env_map, cwd, user, timeout)

    sys.exit(run_async(_with_vm)(vm_id, action))


async def _stream(
    agent: AgentClient,
    argv: list[str],
    env: dict[str, str],
    cwd: str | None,
    user: str | None,
    timeout: float | None,
) -> int:
    feed_stdin = not sys.stdin.isatty()
    proc = await agent.exec(argv, env=env, cwd=cwd, user=user, timeout=timeout, stdin=feed_stdin)

    async def pump_stdin() -> None:
        loop = asyncio.get_running_loop()
        stdin = sys.stdin.fileno()
        while chunk := await loop.run_in_executor(None, os.read, stdin, 65536):
            await proc.write(chunk)
        await proc.close_stdin()

    feeder = asyncio.ensure_future(pump_stdin()) if feed_stdin else None
    async for stream, data in proc:
        out = sys.stdout if stream == "stdout" else sys.stderr
        out.buffer.write(data)
        out.flush()
    if feeder is not None:
        feeder.cancel()
    result = await proc.wait()
    if result.timed_out:
        click.echo(f"space: timed out after {timeout}s, killed", err=True)
    if result.signal is not None:
        return 128 + result.signal
    return result.exit_code or 0


async def _interactive(
    agent: AgentClient, argv: list[str], env: dict[str, str], cwd: str | None, user: str | None
) -> int:
    cols, rows = shutil.get_terminal_size()
    proc = await agent.exec(argv, env=env, cwd=cwd, user=user, pty=True, rows=rows, cols=cols)
    loop = asyncio.get_running_loop()
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd) if os.isatty(fd) else None
    if saved is not None:
        tty.setraw(fd)

    # Keystrokes and resizes go out in order through one queue.
    outbox: asyncio.Queue[bytes | tuple[int, int] | None] = asyncio.Queue()

    def on_input() -> None:
        data = os.read(fd, 4096)
        outbox.put_nowait(data or None)

    def on_resize() -> None:
        c, r = shutil.get_terminal_size()
        outbox.put_nowait((r, c))

    async def forward() -> None:
        while True:
            item = await outbox.get()
            if item is None:
                await proc.close_stdin()
            elif isinstance(item, tuple):
                await proc.resize(*item)
            else:
                await proc.write(item)

    loop.add_reader(fd, on_input)
    loop.add_signal_handler(signal.SIGWINCH, on_resize)
    forwarder = asyncio.ensure_future(forward())
    try:
        async for _, data in proc:
            sys.stdout.buffer.write(data)
            sys.stdout.flush()
        result = await proc.wait()
    finally:
        forwarder.cancel()
        loop.remove_reader(fd)
        loop.remove_signal_handler(signal.SIGWINCH)
        if saved is not None:
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)
    return result.exit_code if result.exit_code is not None else 128 + (result.signal or 0)


@vm.command()
@click.argument("vm_id")
@run_async
async def pause(vm_id: str) -> None:
    """Stop a VM's vCPUs (memory stays)."""
    v = await _adopt(vm_id)
    await v.pause()
    await v.detach()


@vm.command()
@click.argument("vm_id")
@run_async
async def resume(vm_id: str) -> None:
    """Resume a paused VM."""
    v = await _adopt(vm_id)
    await v.resume()
    await v.detach()


@vm.command()
@click.argument("vm_id")
@click.argument("dest", type=click.Path(path_type=Path))
@click.option("--resume/--stay-paused", default=True, show_default=True)
def snapshot(vm_id: str, dest: Path, resume: bool) -> None:
    """Save a VM's memory, devices and disk into DEST."""

    async def action(v: Any, agent: AgentClient) -> SnapshotInfo:
        await agent.sync()
        info: SnapshotInfo = await v.snapshot(dest)
        if resume:
            await v.resume()
        return info

    info = run_async(_with_vm)(vm_id, action)
    click.echo(f"snapshot in {info.took_s:.2f}s, {info.size_bytes() / 2**20:.1f} MiB: {dest}")


@vm.command()
@click.argument("snapshot_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--id", "vm_id")
@click.option("--hostname")
@run_async
async def restore(snapshot_dir: Path, vm_id: str | None, hostname: str | None) -> None:
    """Start a new VM from a snapshot directory."""
    rt = await _runtime()
    snap = SnapshotInfo.load(snapshot_dir)
    m = await Machine.restore(rt.driver, rt.pool, snap, vm_id=vm_id, hostname=hostname)
    await m.agent.close()
    await m.vm.detach()
    click.echo(f"{m.id}  restored in {sum(m.timings.values()) * 1000:.0f} ms")


@vm.command()
@click.argument("vm_id")
@run_async
async def console(vm_id: str) -> None:
    """Print a VM's serial console log."""
    pool = await asyncio.to_thread(ensure_pool)
    log_file = pool.vms / vm_id / "console.log"
    if not log_file.exists():
        raise click.ClickException(f"no VM {vm_id} on this host")
    click.echo(log_file.read_text(errors="replace"), nl=False)


@vm.command()
@click.argument("vm_ids", nargs=-1, required=True)
@run_async
async def rm(vm_ids: tuple[str, ...]) -> None:
    """Kill VMs and remove their disks and files."""
    pool = await asyncio.to_thread(ensure_pool)
    for vm_id in vm_ids:
        run_dir = pool.vms / vm_id
        if not run_dir.exists():
            raise click.ClickException(f"no VM {vm_id} on this host")
        with contextlib.suppress(VMMError):
            v = await QemuDriver().adopt(run_dir)
            await v.kill()
        shutil.rmtree(run_dir, ignore_errors=True)
        click.echo(f"{vm_id} removed")
