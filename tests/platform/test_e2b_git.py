"""git in real sandboxes against a private git host in the test world (git's smart HTTP behind
basic authentication, reached through the sandbox's gateway).

Through the unmodified `e2b` SDK's `sandbox.git`: clone, commit and push land in the host's
repository; a wrong password is E2B's authentication error; the password is not left in the
clone; a host the sandbox's egress policy does not allow is not reached. SPACE's own way: over
HTTPS with the credential a secret the gateway adds to requests to that host only, so the guest
never holds it."""

from __future__ import annotations

import base64
import hashlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import Sandbox
from e2b.exceptions import GitAuthException

from ..network.world import GIT_PASSWORD
from ..stack import Platform
from .helpers import create, out, run
from .test_e2b import opts

pytestmark = pytest.mark.vm

# Plain HTTP: E2B's network options cannot ask the gateway to inspect TLS, and without that a
# guest sees the test world's own certificate, which only the gateway trusts.
REPO = "http://allowed.test/git/project.git"


def git(*args: str, cwd: Path | None = None) -> bytes:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, timeout=60,
                          check=True).stdout  # fmt: skip


@pytest.fixture
def origin(platform: Platform, tmp_path: Path) -> Iterator[Path]:
    """A bare repository on the git host with one commit on `main`."""
    bare = platform.internet.git_root / "project.git"
    git("init", "--quiet", "--bare", "--initial-branch=main", str(bare))
    work = tmp_path / "work"
    git("init", "--quiet", "--initial-branch=main", str(work))
    (work / "README").write_text("hello from the host\n")
    git("add", "README", cwd=work)
    git("-c", "user.name=Host", "-c", "user.email=host@example.test", "commit", "--quiet",
        "-m", "readme", cwd=work)  # fmt: skip
    git("push", "--quiet", str(bare), "main", cwd=work)
    yield bare
    shutil.rmtree(bare, ignore_errors=True)


def test_clone_commit_and_push_reach_the_git_host(platform: Platform, origin: Path) -> None:
    sbx = Sandbox.create(timeout=600, network={"allow_out": ["allowed.test"]}, **opts(platform))
    try:
        with pytest.raises(GitAuthException):
            sbx.git.clone(REPO, path="/home/user/wrong", username="git", password="not-it")
        sbx.git.clone(REPO, path="/home/user/project", username="git", password=GIT_PASSWORD)
        assert sbx.files.read("/home/user/project/README") == "hello from the host\n"
        # The password served the clone and is not kept in it.
        remote = sbx.git.remote_get("/home/user/project", "origin")
        assert remote == REPO, remote
        assert GIT_PASSWORD not in sbx.commands.run("cat /home/user/project/.git/config").stdout

        sbx.git.configure_user("Agent", "agent@example.test", scope="global")
        sbx.files.write("/home/user/project/notes.txt", "written in the sandbox\n")
        sbx.git.add("/home/user/project", all=True)
        sbx.git.commit("/home/user/project", "notes from the agent")
        status = sbx.git.status("/home/user/project")
        assert status.ahead == 1, status
        sbx.git.push("/home/user/project", username="git", password=GIT_PASSWORD)
        assert git("--git-dir", str(origin), "log", "-1", "--format=%s %an") == \
            b"notes from the agent Agent\n"  # fmt: skip
        assert git("--git-dir", str(origin), "show", "main:notes.txt") == \
            b"written in the sandbox\n"  # fmt: skip
        assert GIT_PASSWORD not in sbx.commands.run("cat /home/user/project/.git/config").stdout

        # The same host under a name the sandbox's policy does not allow is not reached.
        seen = len(platform.internet.internet_events())
        with pytest.raises(Exception) as denied:
            sbx.git.clone(REPO.replace("allowed.test", "other.test"), path="/home/user/denied",
                          username="git", password=GIT_PASSWORD)  # fmt: skip
        assert not isinstance(denied.value, GitAuthException), denied.value
        events = platform.internet.internet_events()[seen:]
        hosts = [h.get("host") for e in events if isinstance(h := e.get("headers"), dict)]
        assert "other.test" not in hosts, hosts
    finally:
        sbx.kill()


def test_a_push_over_https_with_a_credential_the_guest_never_holds(
    platform: Platform, origin: Path
) -> None:
    basic = base64.b64encode(f"git:{GIT_PASSWORD}".encode()).decode()
    with platform.client() as c:
        assert c.put("/v1/secrets/git", json={"value": f"Basic {basic}"}).status_code == 200
        hosts = [{"pattern": "allowed.test"}, {"pattern": "other.test"}]
        sid = create(c, network={"hosts": hosts},
                     secrets=[{"secret": "git", "hosts": ["allowed.test"],
                               "header": "Authorization"}])["id"]  # fmt: skip
        try:
            url = "https://allowed.test/git/project.git"
            out(c, sid, f"git clone -q {url} /root/project")  # TLS the gateway's, trusted
            # 2 MiB that do not compress: past git's post buffer, the push is sent chunked.
            sent = out(c, sid, "cd /root/project && echo pushed > pushed.txt && "
                        "head -c 2097152 /dev/urandom > blob && git add pushed.txt blob && "
                        "git -c user.name=Agent -c user.email=a@example.test commit -qm agent && "
                        "git push -q origin main && sha256sum blob")  # fmt: skip
            assert git("--git-dir", str(origin), "show", "main:pushed.txt") == b"pushed\n"
            blob = git("--git-dir", str(origin), "show", "main:blob")
            assert len(blob) == 2 << 20 and sent.split()[0] == hashlib.sha256(blob).hexdigest()
            _, _, found = run(c, sid, f"grep -rqs -e {GIT_PASSWORD} -e {basic} /root /etc /tmp")
            assert found == 1  # not in the guest's files
            # To another host, allowed but not bound, the credential is not added: the git host
            # there asks for one, and the guest has none to give.
            _, stderr, code = run(c, sid, "GIT_TERMINAL_PROMPT=0 git ls-remote "
                                          "http://other.test/git/project.git")  # fmt: skip
            assert code != 0 and b"could not read Username" in stderr, stderr
        finally:
            c.delete(f"/v1/sandboxes/{sid}")
            c.delete("/v1/secrets/git")
