"""space.toml: what is accepted, and the errors for what is not."""

from __future__ import annotations

from pathlib import Path

import pytest

from space.worker.templates.errors import SpecError
from space.worker.templates.spec import load_spec, parse_spec

FULL = """
[template]
name = "web"
from = "oci://localhost:5000/team/web:1"
insecure = true
disk_mib = 2048
start = "python3 -m http.server"
ready = "true"

[template.registry]
username_env = "REG_USER"
password_env = "REG_PASS"

[[steps]]
run = "echo hi"
[[steps]]
copy = { src = "app/", dst = "/app" }
[[steps]]
env = { MODE = "prod" }
[[steps]]
workdir = "/app"
[[steps]]
user = "nobody"
"""


def test_full_spec(tmp_path: Path) -> None:
    (tmp_path / "app").mkdir()
    (tmp_path / "space.toml").write_text(FULL)
    spec = load_spec(tmp_path)
    assert spec.name == "web" and spec.insecure and spec.disk_mib == 2048
    assert [s.kind for s in spec.steps] == ["run", "copy", "env", "workdir", "user"]
    copied = spec.steps[1].copied
    assert copied is not None and copied.srcs == ((tmp_path / "app").resolve(),)
    creds = spec.credentials({"REG_USER": "u", "REG_PASS": "p"})
    assert creds is not None and (creds.username, creds.password) == ("u", "p")
    assert "p" not in repr(creds)
    with pytest.raises(SpecError, match="REG_PASS"):
        spec.credentials({"REG_USER": "u"})


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("[template]\nname = 'x'\n", "'from' is required"),
        ("[template]\nname = 'Bad Name'\nfrom = 'dir:/'\n", "must be lower-case"),
        ("[template]\nname = 'x'\nfrom = 'ftp://x'\n", "names no known source"),
        ("[template]\nname = 'x'\nfrom = 'debian:sid'\n", "only debian:bookworm"),
        ("[template]\nname = 'x'\nfrom = 'dir:/'\ncolour = 1\n", "unknown key.*colour"),
        (
            "[template]\nname = 'x'\nfrom = 'dir:/'\n[template.registry]\npassword = 'hunter2'\n",
            "secrets never go into spec files",
        ),
        (
            "[template]\nname = 'x'\nfrom = 'dir:/'\n[[steps]]\nrun = 'a'\nuser = 'b'\n",
            "exactly one",
        ),
        ("[template]\nname = 'x'\nfrom = 'dir:/'\n[[steps]]\nworkdir = 'rel'\n", "absolute"),
        (
            "[template]\nname = 'x'\nfrom = 'dir:/'\n[[steps]]\n"
            "copy = {src = '../../etc', dst = '/x'}\n",
            "outside the spec's directory",
        ),
        ("[template]\nname = 'x'\nfrom = 'oci://localhost:5000/UP'\n", "bad repository"),
        (
            "[template]\nname = 'x'\nfrom = 'dir:/'\n[[steps]]\n"
            "copy = {src = ['a', 'b'], dst = '/x'}\n",
            "needs a directory as its dst",
        ),
        (
            "[template]\nname = 'x'\nfrom = 'dir:/'\n[[steps]]\ncopy = {src = [], dst = '/x/'}\n",
            "non-empty list",
        ),
        (
            "[template]\nname = 'x'\nfrom = 'dir:/'\n[[steps]]\n"
            "copy = {src = 'a', dst = '/x', chown = 'a b'}\n",
            "chown 'a b'",
        ),
        (
            "[template]\nname = 'x'\nfrom = 'dir:/'\n[[steps]]\n"
            "copy = {src = 'a', dst = '/x', chmod = '999'}\n",
            "octal mode",
        ),
        ("[template]\nname = 'x'\nfrom = 'dir:/'\nignore_file = '../x'\n", "outside the spec"),
        ("not toml [", "not valid TOML"),
    ],
)
def test_bad_specs(tmp_path: Path, text: str, error: str) -> None:
    (tmp_path / "a").write_text("a")
    (tmp_path / "b").write_text("b")
    with pytest.raises(SpecError, match=error):
        parse_spec(text, tmp_path)
