"""Dockerfiles: what each instruction becomes in a template spec, and what is refused (with
its line and the reason). No VM: the build of such a spec is tested in test_build_vm.py."""

from __future__ import annotations

import tarfile
import tomllib
from pathlib import Path
from typing import Any

import pytest

from space.worker.templates.builder import _copy_digest, _copy_tar
from space.worker.templates.dockerfile import dockerfile_spec
from space.worker.templates.errors import SpecError
from space.worker.templates.spec import parse_spec

FULL = """\
# syntax=docker/dockerfile:1
ARG BASE=space:base
FROM ${BASE} AS app
ARG BASE
ARG GREETING=hi
ARG UNSET
ENV APP=/app MODE="prod x"
WORKDIR $APP
COPY --chown=nobody:nogroup --chmod=0640 a.txt *.py ./
COPY ["dir", "sub/"]
RUN echo $GREETING > /etc/greeting && \\
    echo "$MODE"
RUN ["python3", "-c", "print('exec form')"]
USER nobody
EXPOSE 8000
LABEL org.example=1
HEALTHCHECK --interval=5s CMD python3 -c 'import urllib.request as u; u.urlopen("http://127.0.0.1:8000")'
ENTRYPOINT ["python3", "-m"]
CMD ["http.server", "8000"]
"""


def spec_of(text: str, **kw: Any) -> dict[str, Any]:
    return tomllib.loads(dockerfile_spec(text, "web", **kw))


def test_every_instruction_becomes_its_step() -> None:
    spec = spec_of(FULL, build_args={"GREETING": "hello world"})
    tpl = spec["template"]
    assert tpl == {
        "name": "web",
        "from": "space:base",
        "ignore_file": ".dockerignore",
        "start": "python3 -m http.server 8000",
        "ready": "python3 -c 'import urllib.request as u; u.urlopen(\"http://127.0.0.1:8000\")'",
    }
    exports = "export BASE=space:base GREETING='hello world'; "
    assert spec["steps"] == [
        {"env": {"APP": "/app", "MODE": "prod x"}},
        {"workdir": "/app"},
        {"copy": {"src": ["a.txt", "*.py"], "dst": "/app/", "chown": "nobody:nogroup",
                  "chmod": "0640"}},
        {"copy": {"src": "dir", "dst": "/app/sub/"}},
        {"run": exports + 'echo $GREETING > /etc/greeting &&     echo "$MODE"'},
        {"run": exports + "python3 -c 'print('\"'\"'exec form'\"'\"')'"},
        {"user": "nobody"},
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "start"),
    [
        ("CMD python3 app.py # a comment", "/bin/sh -c 'python3 app.py # a comment'"),
        ('CMD ["python3", "a b.py"]', "python3 'a b.py'"),
        ("ENTRYPOINT run-me\nCMD ignored", "/bin/sh -c run-me"),
        ('ENTRYPOINT ["tini", "--"]\nCMD python3 app.py', "tini -- /bin/sh -c 'python3 app.py'"),
        ('ENTRYPOINT ["serve"]', "serve"),
    ],
)
def test_cmd_and_entrypoint_join_as_docker_joins_them(text: str, start: str) -> None:
    assert spec_of(f"FROM debian:bookworm-slim\n{text}\n")["template"]["start"] == start


def test_from_names_an_oci_image_and_build_args_reach_it() -> None:
    text = "ARG TAG=1\nFROM localhost:5000/team/app:${TAG}\nARG TAG\nRUN echo $TAG\n"
    spec = spec_of(text, build_args={"TAG": "2"}, insecure=True)
    assert spec["template"]["from"] == "oci://localhost:5000/team/app:2"
    assert spec["template"]["insecure"] is True
    assert spec["steps"] == [{"run": "export TAG=2; echo $TAG"}]
    # Declared before FROM and not again after it: not in the RUN's environment.
    assert spec_of("ARG TAG=1\nFROM debian\nRUN echo $TAG\n")["steps"] == [{"run": "echo $TAG"}]


@pytest.mark.parametrize(
    ("text", "line", "why"),
    [
        ("FROM a\nFROM b\n", 2, "multi-stage builds are not supported"),
        ("FROM a\nCOPY --from=build /x /y\n", 2, "COPY --from"),
        ("FROM a\nADD https://example.com/x /x\n", 2, "fetches nothing from outside"),
        ("FROM a\nADD git@github.com:a/b /b\n", 2, "fetches nothing from outside"),
        ("FROM a\nADD app.tar.gz /app\n", 2, "ADD unpacks archives"),
        ("FROM a\nRUN --mount=type=cache,target=/x true\n", 2, "mount"),
        ("FROM a\nRUN --network=none true\n", 2, "network"),
        ("FROM a\nRUN <<EOF\necho hi\nEOF\n", 2, "here-documents"),
        ('FROM a\nSHELL ["/bin/bash", "-c"]\n', 2, "RUN uses /bin/sh -c"),
        ("FROM a\nVOLUME /data\n", 2, "volumes are attached"),
        ("FROM a\nONBUILD RUN true\n", 2, "not parents"),
        ("FROM a\nSTOPSIGNAL SIGTERM\n", 2, "not by a signal"),
        ("RUN true\nFROM a\n", 1, "only ARG may come before"),
        ("FROM scratch\n", 1, "no python3"),
        ("FROM --platform=linux/arm64 a\n", 1, "linux/amd64"),
        ("FROM oci://x/y\n", 1, "name an image"),
        ("FROM a\nENV 1BAD=x\n", 2, "not a variable name"),
        ("FROM a\nCOPY onlyone\n", 2, "sources and a destination"),
        ("FROM a\nHEALTHCHECK --interval=1s\n", 2, "NONE or CMD"),
        ("FROM a\nCOPY --chown a /b\n", 2, "needs a value"),
        ("FROM a\nCOPY --chown='a b' x /b\n", 2, "--chown=a b: must match"),
        ("FROM a\nCOPY --chmod=999 x /b\n", 2, "--chmod=999: must match"),
        ("FROM a\nCOPY ../secret /b\n", 2, "outside the build context"),
        ("FROM a\nADD ftp://example.com/x /x\n", 2, "fetches nothing from outside"),
        ("FROM a\nRUN []\n", 2, "an empty command"),
        ("FROM $UNSET\n", 1, "names no image"),
        ("FROM a\nENV A=x\n" + "ENV A=$A$A\n" * 20, 19, "expands to more than"),
    ],
)
def test_what_is_refused_says_its_line_and_why(text: str, line: int, why: str) -> None:
    with pytest.raises(SpecError, match=rf"line {line}: .*{why}"):
        dockerfile_spec(text, "x")


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "no FROM"),
        ("# escape=`\nFROM a\n", "escape character"),
        ("FROM a\nBOGUS x\n", "line 2"),
        ("FROM a\n" + "RUN true\n" * 200_000, "larger than"),
    ],
)
def test_unreadable_dockerfiles_are_refused(text: str, why: str) -> None:
    with pytest.raises(SpecError, match=why):
        dockerfile_spec(text, "x")


def test_wildcards_match_names_not_links_and_a_name_that_exists_is_itself(
    tmp_path: Path,
) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "real/a.txt").write_text("a")
    (tmp_path / "link").symlink_to("real")
    (tmp_path / "b[1].txt").write_text("b")
    spec = parse_spec(dockerfile_spec("FROM a\nCOPY */*.txt b[1].txt /x/\n", "x"), tmp_path)
    copied = spec.steps[0].copied
    assert copied is not None
    assert [p.relative_to(tmp_path).as_posix() for p in copied.srcs] == ["real/a.txt", "b[1].txt"]


def test_the_spec_it_becomes_copies_what_dockerignore_keeps(tmp_path: Path) -> None:
    files = ("a.py", "b.py", ".hidden.py", "skip.py", "dir/keep.txt", "dir/x.log",
             "dir/sub/drop.txt", "dir/sub/back.txt")  # fmt: skip
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    (tmp_path / ".dockerignore").write_text("# comment\nskip.py\n**/*.log\ndir/sub\n"
                                            "!dir/sub/back.txt\n")  # fmt: skip
    (tmp_path / "out").symlink_to("/etc")
    text = "FROM debian\nCOPY *.py /app/\nCOPY dir /app/dir\n"
    spec = parse_spec(dockerfile_spec(text, "x"), tmp_path)
    first, second = spec.steps
    assert first.copied is not None and second.copied is not None
    assert [p.name for p in first.copied.srcs] == [".hidden.py", "a.py", "b.py"]
    assert _copy_tar(second, tmp_path / "copy.tar") == "/app/dir"
    with tarfile.open(tmp_path / "copy.tar") as tf:
        assert sorted(tf.getnames()) == ["keep.txt", "sub/back.txt"]
    # What the ignore file leaves out is not in the step's key either.
    before = _copy_digest(second)
    (tmp_path / "dir/x.log").write_text("changed")
    (tmp_path / "dir/sub/drop.txt").write_text("changed")
    assert _copy_digest(second) == before
    (tmp_path / "dir/sub/back.txt").write_text("changed")
    assert _copy_digest(second) != before

    with pytest.raises(SpecError, match="excluded by the ignore file"):
        parse_spec(dockerfile_spec("FROM debian\nCOPY skip.py /x\n", "x"), tmp_path)
    with pytest.raises(SpecError, match="outside the spec's directory"):
        parse_spec(dockerfile_spec("FROM debian\nCOPY out /x\n", "x"), tmp_path)
    with pytest.raises(SpecError, match="matches nothing"):
        parse_spec(dockerfile_spec("FROM debian\nCOPY *.rs /x/\n", "x"), tmp_path)


def test_a_wildcards_key_changes_with_the_names_it_matches(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("same")
    text = dockerfile_spec("FROM debian\nCOPY *.txt /d/\n", "x")
    before = _copy_digest(parse_spec(text, tmp_path).steps[0])
    (tmp_path / "a.txt").rename(tmp_path / "b.txt")
    assert _copy_digest(parse_spec(text, tmp_path).steps[0]) != before


def test_sources_are_the_contexts_and_the_spec_stays_bounded() -> None:
    steps = spec_of("FROM a\nCOPY /etc/conf ./x /app/\n")["steps"]
    assert steps == [{"copy": {"src": ["etc/conf", "x"], "dst": "/app/"}}]
    # Every RUN carries the build arguments in scope: a spec past 1 MiB is refused.
    many = "FROM a\n" + "".join(f"ARG A{i}={'x' * 60000}\n" for i in range(2)) + "RUN true\n" * 20
    with pytest.raises(SpecError, match="larger than"):
        dockerfile_spec(many, "x")
