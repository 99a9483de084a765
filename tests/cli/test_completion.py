"""Shell completion: the scripts `space completion SHELL` prints, driven for real in bash, and
sandbox ids completed from a loopback stand-in of the API."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.runner import space
from tests.cli.stub_api import StubAPI, sandbox

BIN = Path(sys.executable).parent  # where the `space` entry point is installed


def bash_complete(words: str, env: dict[str, str]) -> list[str]:
    """What bash offers for the last of `words`, through the script `space completion bash`
    prints, with `space` found on PATH as a user's shell finds it."""
    script = (
        'eval "$(space completion bash)"\n'
        f"COMP_WORDS=({words}); COMP_CWORD=$(( ${{#COMP_WORDS[@]}} - 1 ))\n"
        '[[ "$1" == *" " ]] && { COMP_WORDS+=(""); COMP_CWORD=$((COMP_CWORD + 1)); }\n'
        "_space_completion space\n"
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    run = subprocess.run(
        ["bash", "-c", script, "bash", words],
        capture_output=True,
        text=True,
        env={**os.environ, **env, "PATH": f"{BIN}:{os.environ['PATH']}"},
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    return [line for line in run.stdout.splitlines() if line]


@pytest.mark.parametrize(
    ("shell", "marks"),
    [
        ("bash", ["_SPACE_COMPLETE=bash_complete", "complete -o nosort -F _space_completion"]),
        ("zsh", ["#compdef space", "_SPACE_COMPLETE=zsh_complete"]),
        ("fish", ["_SPACE_COMPLETE=fish_complete", "complete --no-files --command space"]),
    ],
)
def test_each_shell_gets_its_script(shell: str, marks: list[str]) -> None:
    script = space("completion", shell).stdout
    for mark in marks:
        assert mark in script
    if shutil.which(shell):  # the shell itself checks the syntax where it is installed
        subprocess.run([shell, "-n"], input=script, text=True, check=True, timeout=30)


def test_an_unknown_shell_is_refused() -> None:
    run = space("completion", "tcsh", status=2)
    assert "'tcsh' is not one of 'bash', 'zsh', 'fish'" in run.stderr


def test_bash_completes_commands_and_options() -> None:
    assert {"sandbox", "exec", "doctor", "completion"} <= set(bash_complete("space ", {}))
    assert bash_complete("space sand", {}) == ["sandbox"]
    assert set(bash_complete("space sandbox ", {})) >= {"create", "ls", "rm", "get"}
    assert "--json" in bash_complete("space sandbox ls --", {})
    assert bash_complete("space doctor --only n", {}) == ["netns", "nftables"]


def test_bash_completes_sandbox_ids_from_the_api() -> None:
    rows = [sandbox(1), sandbox(2), sandbox(3, id="sb-other")]
    with StubAPI(rows) as api:
        assert bash_complete("space sandbox rm sb-0", api.env()) == [rows[0]["id"], rows[1]["id"]]
        assert bash_complete("space exec sb-o", api.env()) == ["sb-other"]
        # Arguments already given do not stop it; neither do options before the id.
        assert bash_complete(f"space sandbox rm {rows[0]['id']} sb-ot", api.env()) == ["sb-other"]
        assert bash_complete("space exec --cwd /tmp sb-o", api.env()) == ["sb-other"]
        assert len(api.requests) == 4


def test_ids_come_from_the_api_the_command_line_names() -> None:
    with StubAPI([sandbox(9)]) as api:
        env = {"SPACE_API_URL": "http://127.0.0.1:9", "SPACE_API_KEY": api.env()["SPACE_API_KEY"]}
        words = f"space sandbox get --api-url {api.url} sb-"
        assert bash_complete(words, env) == [sandbox(9)["id"]]


def test_a_silent_api_completes_nothing_and_never_hangs_the_shell() -> None:
    # A listener that accepts and never answers; the completion gives up after its deadline.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        env = {"SPACE_API_URL": f"http://127.0.0.1:{silent.getsockname()[1]}",
               "SPACE_API_KEY": "sk_x"}  # fmt: skip
        assert bash_complete("space sandbox rm sb-", env) == []
    refused = {"SPACE_API_URL": "http://127.0.0.1:9", "SPACE_API_KEY": "sk_x"}
    assert bash_complete("space exec ", refused) == []
    # Without any key: nothing offered, and nothing printed about it either.
    env = {k: v for k, v in os.environ.items() if k != "SPACE_API_KEY"}
    env |= {
        "SPACE_API_URL": "http://127.0.0.1:9",
        "XDG_CONFIG_HOME": "/nonexistent",
        "_SPACE_COMPLETE": "bash_complete",
        "COMP_WORDS": "space exec sb",
        "COMP_CWORD": "2",
    }
    run = subprocess.run([sys.executable, "-m", "space.cli.main"], env=env, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert (run.returncode, run.stdout.strip(), run.stderr) == (0, "", "")
