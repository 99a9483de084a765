"""E2B's template steps as a SPACE spec, and the files its COPY steps uploaded as a context:
what each step becomes, what is refused, and files that would leave the context. No VM."""

from __future__ import annotations

import io
import tarfile
import tomllib
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from space.api.errors import APIError
from space.e2b.template_spec import (
    REGISTRY_PASSWORD,
    REGISTRY_USER,
    StartBuild,
    build_files,
    steps_spec,
)
from space.worker.templates.spec import parse_spec

H = "a" * 64


def spec_of(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    text, environ = steps_spec("web-0123456789", StartBuild.model_validate(body))
    return tomllib.loads(text), environ


def files(*members: tuple[str, bytes | None]) -> bytes:
    """A gzipped tar as the SDK uploads it: (name, content), None for a directory."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
            else:
                info.size = len(data)
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def test_every_step_becomes_its_spec_step() -> None:
    spec, environ = spec_of({
        "fromImage": "127.0.0.1:5000/team/app:1",
        "fromImageRegistry": {"type": "registry", "username": "u", "password": "p"},
        "startCmd": "python3 -m http.server", "readyCmd": "true",
        "steps": [
            {"type": "RUN", "args": ["apt-get update", "root"]},
            {"type": "COPY", "args": ["app", "/srv/", "nobody", "0640"], "filesHash": H},
            {"type": "ENV", "args": ["A", "1", "B", "two words"]},
            {"type": "WORKDIR", "args": ["/opt"]},
            {"type": "WORKDIR", "args": ["app"]},
            {"type": "COPY", "args": ["conf", "etc/"], "filesHash": H},
            {"type": "USER", "args": ["nobody"]},
            {"type": "RUN", "args": ["make"]},
        ],
    })  # fmt: skip
    assert spec["template"] == {
        "name": "web-0123456789", "from": "oci://127.0.0.1:5000/team/app:1", "insecure": True,
        "registry": {"username_env": REGISTRY_USER, "password_env": REGISTRY_PASSWORD},
        "start": "python3 -m http.server", "ready": "true",
    }  # fmt: skip
    assert environ == {REGISTRY_USER: "u", REGISTRY_PASSWORD: "p"}
    assert spec["steps"] == [
        {"run": {"cmd": "apt-get update", "user": "root"}},
        {"copy": {"src": f"{H}/app", "dst": "/srv/", "chown": "nobody", "chmod": "0640"}},
        {"env": {"A": "1", "B": "two words"}},
        {"workdir": "/opt"},
        {"workdir": "/opt/app"},
        {"copy": {"src": f"{H}/conf", "dst": "/opt/app/etc/"}},
        {"user": "nobody"},
        {"run": "make"},
    ]


@pytest.mark.parametrize(
    ("body", "source"),
    [
        ({}, {"from": "space:base"}),  # the SDK's default, e2bdev/base
        ({"fromTemplate": "code-interpreter"}, {"from": "space:code-interpreter"}),
        ({"fromImage": "registry.example.com/a:1"}, {"from": "oci://registry.example.com/a:1"}),
    ],
)
def test_sources(body: dict[str, Any], source: dict[str, Any]) -> None:
    template = spec_of(body)[0]["template"]
    assert {k: v for k, v in template.items() if k != "name"} == source


@pytest.mark.parametrize(
    ("body", "why"),
    [
        ({"fromTemplate": "mine"}, "fromTemplate 'mine'"),
        ({"fromImage": "Ubuntu:22.04"}, "fromImage 'Ubuntu:22.04'"),
        ({"fromTemplate": "base", "fromImage": "x"}, "not both"),
        ({"fromImageRegistry": {"type": "aws"}, "fromImage": "x"}, "type registry"),
        ({"steps": [{"type": "RUN", "args": [" "]}]}, "step 1 \\(RUN\\)"),
        ({"steps": [{"type": "COPY", "args": ["a", "/b"]}]}, "filesHash"),
        ({"steps": [{"type": "COPY", "args": ["../a", "/b"], "filesHash": H}]}, "file context"),
        ({"steps": [{"type": "COPY", "args": ["a", "/b", "a b"], "filesHash": H}]}, "user"),
        ({"steps": [{"type": "COPY", "args": ["a", "/b", "", "999"], "filesHash": H}]}, "mode"),
        ({"steps": [{"type": "ENV", "args": ["A"]}]}, "names and values"),
        ({"steps": [{"type": "ARG", "args": ["A"]}]}, "SPACE builds RUN, COPY"),
        ({"steps": [{"type": "COPY", "args": ["a", "b/"], "filesHash": H}]}, "give a WORKDIR"),
        ({"steps": [{"type": "WORKDIR", "args": ["rel"]}]}, "give a WORKDIR"),
        (
            {"fromImage": "x", "fromImageRegistry": {"type": "registry", "username": "u"}},
            "a username and a password",
        ),
        ({"steps": [{"type": "RUN", "args": ["x" * 70000]}] * 20}, "larger than"),
    ],
)
def test_what_cannot_be_built_is_refused(body: dict[str, Any], why: str) -> None:
    with pytest.raises(APIError, match=why) as refused:
        spec_of(body)
    assert refused.value.status == 400


def test_uploaded_files_become_the_context_the_spec_copies_from(tmp_path: Path) -> None:
    uploaded = {H: files(("app", None), ("app/a.txt", b"a"), ("app/sub/b.txt", b"b"))}
    context = build_files(uploaded, [H, H])
    with tarfile.open(fileobj=io.BytesIO(context)) as tf:
        tf.extractall(tmp_path, filter="data")
    text, _ = steps_spec("web-0123456789", StartBuild.model_validate({
        "steps": [{"type": "COPY", "args": ["app", "/srv/"], "filesHash": H}],
    }))  # fmt: skip
    copied = parse_spec(text, tmp_path).steps[0].copied
    assert copied is not None and copied.srcs == ((tmp_path / H / "app").resolve(),)
    assert (tmp_path / H / "app/sub/b.txt").read_bytes() == b"b"


@pytest.mark.parametrize(
    ("uploaded", "why"),
    [
        ({}, "were not uploaded"),
        ({H: files(("../escape", b"x"))}, "inside the file context"),
        ({H: files(("/etc/passwd", b"x"))}, "inside the file context"),
        ({H: b"not a tar"}, "not a tar"),
    ],
)
def test_files_that_cannot_be_a_context_are_refused(uploaded: dict[str, bytes], why: str) -> None:
    with pytest.raises(APIError, match=why):
        build_files(uploaded, [H])


def test_files_uploaded_without_gzip_are_a_context_too() -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        info = tarfile.TarInfo("a.txt")
        info.size = 1
        tf.addfile(info, io.BytesIO(b"a"))
    with tarfile.open(fileobj=io.BytesIO(build_files({H: buf.getvalue()}, [H]))) as tf:
        assert tf.getnames() == [f"{H}/a.txt"]


def link(name: str, target: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        info = tarfile.TarInfo(name)
        info.type, info.linkname = tarfile.SYMTYPE, target
        tf.addfile(info)
    return buf.getvalue()


def test_links_stay_among_their_files_and_what_is_unpacked_is_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    build_files({H: link("app/ok", "../app/x")}, [H])
    for target in ("/etc/shadow", "../../x", "../.."):
        with pytest.raises(APIError, match="inside the file context"):
            build_files({H: link("app/bad", target)}, [H])
    monkeypatch.setattr("space.e2b.template_spec.MAX_CONTEXT_BYTES", 4096)
    with pytest.raises(APIError, match="more than 0 MiB unpacked") as big:
        build_files({H: files(("big", bytes(8192)))}, [H])
    assert big.value.status == 413


def test_text_a_spec_cannot_hold_is_refused_before_anything() -> None:
    for value in ("nul\x00", "lone \ud800"):
        with pytest.raises(ValidationError, match="NUL or a lone surrogate"):
            StartBuild.model_validate({"steps": [{"type": "RUN", "args": [value]}]})
