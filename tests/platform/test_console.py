"""The web console in a real browser (the distribution's Chromium, driven by Playwright): a wrong
key is refused; with a right one it lists sandboxes, creates one, runs a command in its terminal
and reads the output on the page, uploads and downloads a file, shows every page, and deletes
the sandbox; an admin key makes a tenant and a key there, which works until it is revoked there,
and sees the workers; a tenant's key sees neither page. No page breaks its
Content-Security-Policy. A screenshot of each page is saved in the test's tmp directory."""

from __future__ import annotations

import contextlib
import re
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from ..network.world import ORIGINS
from ..stack import Platform
from .helpers import fetch, run

CHROMIUM = Path("/usr/bin/chromium")
# As root, and with nothing reaching out of this machine.
ARGS = ["--no-sandbox", "--disable-gpu", "--headless", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip
WAIT_MS = 120_000  # a create, a shell start or a build step under TCG on a busy host
expect.set_options(timeout=WAIT_MS)  # (expect has a clock of its own, 5 s by default)
VIOLATIONS = """
window.__violations = [];
addEventListener("securitypolicyviolation",
  (e) => window.__violations.push(`${e.violatedDirective} ${e.blockedURI}`));
"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if not CHROMIUM.exists():
        pytest.fail("the console tests need Chromium: apt-get install chromium (make test-deps)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


# What sticks out past the right edge of the screen (the last five, deepest last).
OVERFLOWING = """
[...document.querySelectorAll("body *")]
  .filter((e) => e.getBoundingClientRect().right > innerWidth)
  .slice(-5).map((e) => `${e.tagName}.${e.className}: ${e.getBoundingClientRect().right}`)
"""


def overflowing(page: Page) -> list[str]:
    """Elements wider than the screen ([] when the page fits it)."""
    if page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"):
        return []
    widths = page.evaluate("[document.documentElement.scrollWidth, innerWidth]")
    return list(page.evaluate(OVERFLOWING)) or [f"the page itself: {widths}"]


def shot(page: Page, tmp_path: Path, name: str) -> None:
    page.screenshot(path=str(tmp_path / f"console-{name}.png"), full_page=True)


def sign_in(page: Page, key: str) -> None:
    page.fill("input[name=key]", key)
    page.click("button[type=submit]")


@contextlib.contextmanager
def signed_in(
    platform: Platform, browser: Browser, key: str, width: int = 1360, height: int = 900,
    **options: Any,
) -> Iterator[Page]:  # fmt: skip
    """A page of the console signed in with `key`; once done, it broke no CSP rule and no
    script failed on it."""
    context = browser.new_context(viewport={"width": width, "height": height}, **options)
    context.add_init_script(VIOLATIONS)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.set_default_timeout(WAIT_MS)
    page.goto(f"{platform.api_url}/console/")
    sign_in(page, key)
    try:
        yield page
        assert page.evaluate("window.__violations") == [], "the page broke its CSP"
        assert errors == []
    finally:
        context.close()


def test_the_page_and_its_assets_are_served_strictly(platform: Platform) -> None:
    r = httpx.get(f"{platform.api_url}/console", follow_redirects=True)
    assert r.status_code == 200 and r.url.path == "/console/"
    assert r.headers["content-type"] == "text/html; charset=utf-8"
    csp = r.headers["content-security-policy"]
    nonce = re.search(r"'nonce-([^']+)'", csp)
    assert nonce and f'nonce="{nonce.group(1)}"' in r.text
    for directive in ("default-src 'none'", "connect-src 'self'", "frame-ancestors 'none'",
                      "base-uri 'none'", "form-action 'none'"):  # fmt: skip
        assert directive in csp, csp
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert r.headers["x-content-type-options"] == "nosniff" and "set-cookie" not in r.headers
    again = httpx.get(f"{platform.api_url}/console/")
    assert again.headers["content-security-policy"] != csp  # a new nonce every time
    assets = re.findall(r'(?:src|href)="(assets/[^"]+)"', r.text)
    kinds = {}
    for asset in assets:
        a = httpx.get(f"{platform.api_url}/console/{asset}")
        assert a.status_code == 200 and "immutable" in a.headers["cache-control"], asset
        kinds[asset.rsplit(".", 1)[1]] = a.headers["content-type"]
    assert kinds == {"js": "text/javascript; charset=utf-8", "css": "text/css; charset=utf-8"}
    for name in ("manifest.json", "../index.html", "nothing.js"):
        assert httpx.get(f"{platform.api_url}/console/assets/{name}").status_code == 404


def test_sign_in_create_terminal_files_and_delete_in_a_browser(
    platform: Platform, browser: Browser, tmp_path: Path
) -> None:
    context = browser.new_context(viewport={"width": 1360, "height": 900}, accept_downloads=True)
    context.add_init_script(VIOLATIONS)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.set_default_timeout(WAIT_MS)
    api = platform.client()
    api.put("/v1/secrets/console-demo", json={"value": "never-shown"}).raise_for_status()

    # A wrong key is refused, on the page.
    page.goto(f"{platform.api_url}/console")
    shot(page, tmp_path, "sign-in")
    sign_in(page, "sk_space_wrongwrongwr_" + "x" * 43)
    expect(page.get_by_role("alert")).to_contain_text("That key was refused")
    expect(page.locator(".notice")).to_have_count(0)  # a refusal, not a lost session
    shot(page, tmp_path, "sign-in-refused")

    sign_in(page, platform.key_a)
    expect(page.locator("h1")).to_have_text("Sandboxes")
    page.wait_for_selector("#sandbox-table, .empty")
    page.wait_for_selector(".meters")
    shot(page, tmp_path, "sandboxes")

    # Create one: its environment, a volume, a secret and its egress set in the dialog.
    vol = api.post("/v1/volumes", json={"name": "console-data", "size_mib": 16}).json()["id"]
    page.click("text=New sandbox")
    page.fill("textarea[name=metadata]", "suite=console")
    page.fill("textarea[name=env]", "MODE=browser")
    page.select_option("select[name=egress]", "hosts")
    page.fill("textarea[name=hosts]", "allowed.test")
    page.fill(f"input[name=mount-path-{vol}]", "/data")
    page.check("input[name=secret-console-demo]")
    page.fill("input[name=secret-hosts-console-demo]", "secret.test")
    page.fill("input[name=secret-env-console-demo]", "DEMO")
    shot(page, tmp_path, "create-dialog")
    page.click("button:has-text('Create sandbox')")
    page.wait_for_url(re.compile(r".*#/sandboxes/sb-[0-9a-f]+$"))
    sid = page.url.rsplit("/", 1)[1]
    expect(page.locator(".page-header .badge")).to_have_text("running")
    expect(page.locator("#fig-cpu .figure-value")).to_have_text(re.compile(r"\d"))
    expect(page.locator("#fig-memory .figure-value")).to_contain_text("iB")
    shot(page, tmp_path, "sandbox")
    sb = api.get(f"/v1/sandboxes/{sid}").json()
    assert sb["state"] == "running" and sb["metadata"] == {"suite": "console"}
    assert [h["pattern"] for h in sb["network"]["hosts"]] == ["allowed.test"]
    assert sb["volumes"] == [{"volume": vol, "path": "/data", "read_only": False}]
    assert [(b["secret"], b["hosts"], b["env"]) for b in sb["secrets"]] == [
        ("console-demo", ["secret.test"], "DEMO")]  # fmt: skip
    out, err, code = run(api, sid, "echo $MODE; grep -c ' /data ' /proc/mounts; echo $DEMO")
    mode, mounted, placeholder = out.decode().split()
    assert (code, mode, mounted) == (0, "browser", "1"), err
    assert placeholder.startswith("space-secret-")  # the value itself never enters the guest

    # The terminal: a command typed on the page, its output read from the page.
    page.click("role=tab[name=Terminal]")
    expect(page.locator("#terminal-status")).to_contain_text("Connected")
    page.click("#terminal")
    page.keyboard.type("echo console-$((6*7)) > /root/from-terminal; cat /root/from-terminal")
    page.keyboard.press("Enter")
    expect(page.locator("#terminal .xterm-rows")).to_contain_text("console-42")
    shot(page, tmp_path, "terminal")
    assert api.get(f"/v1/sandboxes/{sid}/files", params={"path": "/root/from-terminal"}).text == (
        "console-42\n"
    )

    # Files: upload one, see it listed, download it again.
    upload = tmp_path / "hello.txt"
    upload.write_bytes(b"hello from the browser\n")
    page.click("role=tab[name=Files]")
    expect(page.locator("#files tr[data-name=from-terminal]")).to_be_visible()
    page.set_input_files("#upload", str(upload))
    expect(page.locator("#files tr[data-name='hello.txt']")).to_be_visible()
    shot(page, tmp_path, "files")
    got = api.get(f"/v1/sandboxes/{sid}/files", params={"path": "/root/hello.txt"})
    assert got.content == upload.read_bytes()
    with page.expect_download() as download:
        page.click("#files tr[data-name='hello.txt'] button.file")
    assert Path(download.value.path()).read_bytes() == upload.read_bytes()

    # Its events, and its egress: one request let out, one refused, as its gateway logged them.
    page.click("role=tab[name=Events]")
    expect(page.locator("#events")).to_contain_text("running")
    shot(page, tmp_path, "events")
    assert fetch(api, sid, "http://allowed.test/")[0] == 0
    assert fetch(api, sid, "http://other.test/")[0] != 0
    page.click("role=tab[name=Egress]")
    expect(page.locator("#audit")).to_contain_text("allowed.test")
    expect(page.locator("#audit .decision-deny").first).to_be_visible()
    shot(page, tmp_path, "egress")

    # A background process started from the page: its output pushed as it comes.
    page.click("role=tab[name=Processes]")
    page.fill("input[name=process-cmd]", "for i in 1 2 3 4; do echo line$i; sleep 1; done")
    page.click("form.toolbar button[type=submit]")
    expect(page.locator("#process-output")).to_contain_text("line1")
    assert "line4" not in page.locator("#process-output").inner_text()  # not waited for
    expect(page.locator("#process-status")).to_have_text("ended: 0")
    expect(page.locator("#process-output")).to_contain_text("line4")
    expect(page.locator("#processes tbody tr").first).to_contain_text("exited 0")
    shot(page, tmp_path, "processes")

    # Its serial console, followed: a line the guest writes there now arrives while we watch.
    page.click("role=tab[name=Logs]")
    expect(page.locator("#logs-status")).to_contain_text("Following")
    assert run(api, sid, "echo console-line-$((6*7)) > /dev/console")[2] == 0
    expect(page.locator("#logs")).to_contain_text("console-line-42")
    shot(page, tmp_path, "logs")

    # Every other page, as a tenant's key sees it.
    for path, marker in (("templates", "#templates"), ("pools", "#pools"),
                         ("volumes", "section"), ("secrets", "#secrets")):  # fmt: skip
        page.click(f".sidebar a[href='#/{path}']")
        page.wait_for_selector(marker)
        shot(page, tmp_path, path)
    expect(page.locator("#secrets")).to_contain_text("console-demo")
    assert "never-shown" not in page.content()
    page.click(".sidebar a[href='#/templates']")
    page.click("#templates a[href='#/templates/base']")
    expect(page.locator("main")).to_contain_text("Build logs are shown to admin keys")
    shot(page, tmp_path, "template")

    # The list shows it, filtered by its metadata; then delete it from its page.
    page.click(".sidebar a[href='#/sandboxes']")
    page.fill("input[name=metadata-filter]", "suite=console")
    expect(page.locator(f"#sandbox-table tr[data-id='{sid}']")).to_be_visible()
    expect(page.locator("#sandbox-table tbody tr")).to_have_count(1)
    shot(page, tmp_path, "sandboxes-filtered")
    page.click(f"#sandbox-table a[href='#/sandboxes/{sid}']")
    page.click("#delete-sandbox")
    page.click(".dialog button.danger")
    expect(page.locator(".page-header .badge")).to_have_text("deleted")
    shot(page, tmp_path, "deleted")
    assert api.get(f"/v1/sandboxes/{sid}").json()["state"] == "deleted"

    # The list leaves deleted sandboxes out unless asked; an id's start finds one.
    page.click(".sidebar a[href='#/sandboxes']")
    page.fill("input[name=id-filter]", sid[:10])
    expect(page.locator("main")).to_contain_text("No sandbox matches")
    page.check("input[name=show-deleted]")
    expect(page.locator(f"#sandbox-table tr.dim[data-id='{sid}']")).to_be_visible()
    page.fill("input[name=id-filter]", sid + "x")
    expect(page.locator("main")).to_contain_text("No sandbox matches")

    assert page.evaluate("window.__violations") == [], "the page broke its CSP"
    assert errors == []
    assert context.cookies() == []  # nothing to ride on for a cross-site request
    assert page.evaluate("Object.keys(localStorage)") == []
    context.close()
    api.delete("/v1/secrets/console-demo")
    assert api.delete(f"/v1/volumes/{vol}").status_code == 200
    api.close()


def test_sandboxes_paused_and_deleted_together_from_the_list(
    platform: Platform, browser: Browser, tmp_path: Path
) -> None:
    """Several sandboxes chosen in the list (those a metadata search found) are paused, then
    deleted after a confirmation naming them, with one action each."""
    tag = secrets.token_hex(4)
    with platform.client(platform.key_b) as b:
        made = [b.post("/v1/sandboxes", json={"metadata": {"batch": tag}}).json()["id"]
                for _ in range(2)]  # fmt: skip
    with signed_in(platform, browser, platform.key_b, 1280, 800) as page:
        page.fill("input[name=metadata-filter]", f"batch={tag}")
        expect(page.locator("#sandbox-table tbody tr")).to_have_count(2)
        page.check("input[name=select-all]")
        expect(page.locator(".bulk")).to_contain_text("2 selected")
        page.click(".bulk button:has-text('Pause')")
        expect(page.locator("#bulk-outcome")).to_contain_text("Pause: 2 asked")
        for sid in made:
            expect(page.locator(f"#sandbox-table tr[data-id='{sid}'] .badge")).to_have_text(
                "paused"
            )
        shot(page, tmp_path, "bulk-paused")
        page.click(".bulk button:has-text('Pause')")  # none is running now: nothing to ask
        expect(page.locator("#bulk-outcome")).to_contain_text("2 not in a state for it")
        page.click(".bulk button.danger")
        expect(page.locator(".dialog")).to_contain_text(made[0])
        page.click(".dialog button.danger")
        expect(page.locator("main")).to_contain_text("No sandbox matches")  # deleted: left out
        with platform.client(platform.key_b) as b:
            for sid in made:
                assert b.get(f"/v1/sandboxes/{sid}").json()["desired_state"] == "deleted"


def test_an_admin_key_builds_a_template_and_follows_its_log_in_a_browser(
    platform: Platform, browser: Browser, tmp_path: Path
) -> None:
    context = browser.new_context(viewport={"width": 1360, "height": 900})
    context.add_init_script(VIOLATIONS)
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    page.goto(f"{platform.api_url}/console/")
    sign_in(page, platform.admin_key)
    expect(page.locator(".whoami")).to_contain_text("admin key")

    page.click(".sidebar a[href='#/templates']")
    page.click("text=Build a template")
    page.fill("input[name=template-id]", "console-demo")
    spec = page.input_value("textarea[name=spec]")
    assert 'name = "console-demo"' in spec and 'from = "debian:bookworm"' in spec
    shot(page, tmp_path, "build-dialog")
    page.click(".dialog button[type=submit]")
    page.wait_for_url(re.compile(r".*#/templates/console-demo$"))
    # The log streams onto the page while the build runs, and ends with the template built
    # (or found built before: the host's build cache outlives the platform).
    expect(page.locator("#build-log")).to_contain_text("step 1")
    expect(page.locator("#build-log")).to_contain_text(
        re.compile(r"template console-demo: (built|\S+ was built before)")
    )
    expect(page.locator(".page-header .badge")).to_have_text("ready")
    shot(page, tmp_path, "build-log")

    # Pools: an admin may size them.
    page.click(".sidebar a[href='#/pools']")
    page.click("#pools tr:has-text('console-demo') button")
    page.fill(".dialog input[name=size]", "1")
    page.click(".dialog button[type=submit]")
    expect(page.locator("#pools tr:has-text('console-demo')")).to_contain_text("/ 1")
    shot(page, tmp_path, "pools-admin")
    with platform.client(platform.admin_key) as admin:
        assert admin.get("/v1/templates/console-demo").json()["pool"]["size"] == 1
        admin.put("/v1/templates/console-demo/pool", json={"size": 0}).raise_for_status()

        # And delete templates, once no sandbox uses them.
        page.click(".sidebar a[href='#/templates']")
        page.click("#templates a[href='#/templates/console-demo']")
        page.click(".page-header button.danger")
        page.click(".dialog button.danger")
        page.wait_for_url(re.compile(r".*#/templates$"))
        expect(page.locator("#templates a[href='#/templates/console-demo']")).to_have_count(0)
        gone = admin.get("/v1/templates/console-demo")
        assert gone.status_code == 404 or gone.json()["state"] == "deleting", gone.text
    assert page.evaluate("window.__violations") == [], "the page broke its CSP"
    context.close()


def test_an_admin_makes_a_tenant_and_a_key_then_revokes_it_in_a_browser(
    platform: Platform, browser: Browser, tmp_path: Path
) -> None:
    with signed_in(
        platform,
        browser,
        platform.admin_key,
        1360,
        900,
        permissions=["clipboard-read", "clipboard-write"],
    ) as page:
        page.click(".sidebar a[href='#/tenants']")
        page.wait_for_selector("#tenants")
        shot(page, tmp_path, "tenants")

        name = f"browser-{secrets.token_hex(4)}"
        page.click("text=New tenant")
        page.fill("input[name=tenant-name]", name)
        page.click(".dialog button[type=submit]")
        page.wait_for_url(re.compile(r".*#/tenants/tn-[0-9a-f]+$"))
        tid = page.url.rsplit("/", 1)[1]
        expect(page.locator(".page-header h1")).to_have_text(name)
        expect(page.locator("main")).to_contain_text("No active keys")

        # A key, shown once, with a button that copies it.
        page.click("text=New key")
        page.fill("input[name=key-name]", "from-the-browser")
        page.click(".dialog button[type=submit]")
        expect(page.locator(".dialog")).to_contain_text("you will not see it again")
        key = page.input_value("#new-key")
        page.click("#copy-key")
        expect(page.locator("#copy-status")).to_have_text("Copied")
        assert page.evaluate("navigator.clipboard.readText()") == key
        shot(page, tmp_path, "key-shown-once")
        page.click(".dialog footer button.primary")
        kid = key.split("_")[2]
        expect(page.locator(f"#keys tr[data-id='{kid}']")).to_contain_text("from-the-browser")
        assert key not in page.content()  # once the dialog is gone, so is the key
        shot(page, tmp_path, "tenant-keys")
        with platform.client(key) as made:
            assert made.get("/v1/me").json()["tenant_id"] == tid

        # Revoked, after a confirmation: refused at once.
        page.click(f"#keys tr[data-id='{kid}'] button.danger")
        expect(page.locator(".dialog")).to_contain_text("refused, at once")
        page.click(".dialog button.danger")
        expect(page.locator(f"#keys tr[data-id='{kid}']")).to_have_count(0)
        with platform.client(key) as made:
            assert made.get("/v1/me").status_code == 401
        page.click(".sidebar a[href='#/tenants']")
        expect(page.locator(f"#tenants tr[data-id='{tid}']")).to_contain_text(name)

        # Renamed, then deleted: what that deletes is stated, and only its name typed confirms it.
        page.click(f"#tenants tr[data-id='{tid}'] a")
        page.click(".page-header button:has-text('Rename')")
        page.fill("input[name=tenant-rename]", f"{name}-2")
        page.click(".dialog button[type=submit]")
        expect(page.locator(".page-header h1")).to_have_text(f"{name}-2")
        page.click(".page-header button.danger")
        expect(page.locator("#deletion")).to_contain_text("0 sandbox(es)")
        expect(page.locator("#delete-tenant")).to_be_disabled()
        page.fill("input[name=confirm-name]", name)  # its old name confirms nothing
        expect(page.locator("#delete-tenant")).to_be_disabled()
        page.fill("input[name=confirm-name]", f"{name}-2")
        shot(page, tmp_path, "tenant-delete")
        page.click("#delete-tenant")
        page.wait_for_url(re.compile(r".*#/tenants$"))
        expect(page.locator("#tenants")).to_be_visible()
        expect(page.locator(f"#tenants tr[data-id='{tid}']")).to_have_count(0)

        # The workers, as GET /v1/workers has them.
        page.click(".sidebar a[href='#/workers']")
        row = page.locator(f"#workers tr[data-id='{platform.worker_id}']")
        expect(row.locator("[data-state]")).to_have_text("active")
        expect(row).to_contain_text("guest RAM")
        shot(page, tmp_path, "workers")


def test_a_tenant_key_sees_no_tenants_or_workers_page(platform: Platform, browser: Browser) -> None:
    context = browser.new_context(viewport={"width": 1360, "height": 900})
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    asked: list[str] = []
    page.on("request", lambda r: asked.append(r.url))
    page.goto(f"{platform.api_url}/console/")
    sign_in(page, platform.key_b)
    expect(page.locator("h1")).to_have_text("Sandboxes")
    expect(page.locator(".sidebar a[href='#/secrets']")).to_be_visible()
    for admin_only in ("tenants", "workers"):
        expect(page.locator(f".sidebar a[href='#/{admin_only}']")).to_have_count(0)
        page.goto(f"{platform.api_url}/console/#/{admin_only}")
        expect(page.locator("main")).to_contain_text("For admin keys only")
    assert not [u for u in asked if "/v1/tenants" in u or "/v1/workers" in u]
    context.close()


@pytest.mark.parametrize("width", [1280, 400])
def test_webhooks_and_the_audit_log_in_a_browser(
    platform: Platform, browser: Browser, tmp_path: Path, width: int
) -> None:
    """At a desktop's width and a phone's: an endpoint added (its secret shown once), one the
    floor refuses, its deliveries, the audit log naming both calls, and the endpoint deleted;
    neither page wider than the screen."""
    with signed_in(platform, browser, platform.key_b, width, 800) as page:
        page.click(".sidebar a[href='#/webhooks']")
        # An origin of the test world's internet: whatever is sent stays on this machine.
        url = f"http://{ORIGINS['allowed.test']}:8080/console-{width}"
        page.click("text=Add a webhook")
        page.fill("input[name=url]", url)
        page.click(".dialog button[type=submit]")
        secret = page.locator("#webhook-secret").inner_text()
        assert secret.startswith("whsec_")
        shot(page, tmp_path, f"webhook-secret-{width}")
        page.click(".dialog footer button.primary")
        row = page.locator("#webhooks tr", has_text=url)
        expect(row).to_contain_text("all")
        assert secret not in page.content()  # shown once
        page.click("text=Add a webhook")
        page.fill("input[name=url]", "http://127.0.0.1:9/")
        page.click(".dialog button[type=submit]")
        expect(page.locator(".dialog .error")).to_contain_text("loopback")
        page.click(".dialog footer button.ghost")
        row.locator("text=Deliveries").click()
        expect(page.locator("main")).to_contain_text("Nothing sent yet")
        assert overflowing(page) == [], "the webhooks page is wider than the screen"
        shot(page, tmp_path, f"webhooks-{width}")

        page.click(".sidebar a[href='#/audit']")
        made = page.locator("#audit tr", has_text="POST /v1/webhooks").first
        expect(made).to_contain_text("201 ok")
        expect(page.locator("#audit tr", has_text="422 refused").first).to_be_visible()
        page.fill("input[name=action]", "DELETE")
        assert overflowing(page) == [], "the audit page is wider than the screen"
        shot(page, tmp_path, f"audit-{width}")

        page.click(".sidebar a[href='#/webhooks']")
        page.locator("#webhooks tr", has_text=url).locator("text=Delete").click()
        page.click(".dialog button.danger")
        expect(page.locator("#webhooks tr", has_text=url)).to_have_count(0)
        page.click(".sidebar a[href='#/audit']")
        expect(
            page.locator("#audit tr", has_text="DELETE /v1/webhooks/{webhook_id}").first
        ).to_contain_text("204 ok")


@pytest.fixture(scope="module")
def metered(platform: Platform) -> Iterator[str]:
    """A sandbox of tenant B that has fetched through its gateway and been metered."""
    with platform.client(platform.key_b) as c:
        sid = c.post(
            "/v1/sandboxes", json={"network": {"hosts": [{"pattern": "allowed.test"}]}}
        ).json()["id"]
        assert fetch(c, sid, "http://allowed.test/")[0] == 0
        # Its bytes and its disk: the disk's size is known from a worker's reading, which may
        # come a round after its first seconds were counted.
        deadline = time.monotonic() + 60
        while not all(c.get("/v1/usage", params={"sandbox": sid}).json()["total"][figure]
                      for figure in ("egress_bytes", "disk_gib_hours")):  # fmt: skip
            assert time.monotonic() < deadline, "the sandbox was never metered"
            time.sleep(0.5)
        yield sid
        c.delete(f"/v1/sandboxes/{sid}")


@pytest.mark.parametrize("width", [1280, 400])
def test_usage_in_a_browser(
    platform: Platform, browser: Browser, tmp_path: Path, width: int, metered: str
) -> None:
    """At a desktop's width and a phone's: the day's charts have bars, the sandbox that used
    most and the host it fetched from are listed, the week and the month draw too, and no
    chart is wider than the screen."""
    with signed_in(platform, browser, platform.key_b, width, 800) as page:
        page.click(".sidebar a[href='#/usage']")
        expect(page.locator("#usage-sandboxes tr", has_text=metered)).to_be_visible()
        expect(page.locator("#usage-hosts")).to_contain_text("allowed.test")
        for chart in ("vcpu", "cpu", "memory", "egress", "storage"):
            assert page.locator(f"#chart-{chart} rect").count() > 0, chart
        assert overflowing(page) == [], "the usage page is wider than the screen"
        shot(page, tmp_path, f"usage-day-{width}")
        for tab in ("Last week", "Last month"):
            page.click(f"role=tab[name='{tab}']")
            expect(page.locator(".tabs a.active")).to_have_text(tab)
            expect(page.locator("#chart-vcpu rect").first).to_be_visible()
            assert overflowing(page) == [], tab
            shot(page, tmp_path, f"usage-{tab.split()[-1]}-{width}")


def test_every_page_fits_a_phones_screen(
    platform: Platform, browser: Browser, tmp_path: Path
) -> None:
    """At 400 px, as an admin sees them: no page is wider than the screen, and the navigation
    leaves most of it to the page."""
    with platform.client(platform.admin_key) as admin:
        sid = admin.post("/v1/sandboxes", json={"metadata": {"for": "phone"}}).json()["id"]
    context = browser.new_context(viewport={"width": 400, "height": 800})
    context.add_init_script(VIOLATIONS)
    page = context.new_page()
    page.set_default_timeout(WAIT_MS)
    page.goto(f"{platform.api_url}/console/")
    sign_in(page, platform.admin_key)
    expect(page.locator("h1")).to_have_text("Sandboxes")
    pages = ["sandboxes", f"sandboxes/{sid}", "templates", "templates/base", "pools", "volumes",
             "secrets", "webhooks", "usage", "usage/month", "audit", "tenants",
             "workers"]  # fmt: skip
    loaded = page.locator("main .spinner")
    for path in pages:
        page.goto(f"{platform.api_url}/console/#/{path}")
        page.wait_for_selector("main h1")
        expect(loaded).to_have_count(0)  # what it shows has come
        assert overflowing(page) == [], path
        assert page.locator(".sidebar").bounding_box()["height"] <= 200, path  # type: ignore[index]
        shot(page, tmp_path, "phone-" + path.replace("/", "-"))
    page.goto(f"{platform.api_url}/console/#/sandboxes/{sid}")
    for tab, marker in (("Terminal", "#terminal-status"), ("Files", "#files"),
                        ("Processes", "#processes, .empty"), ("Logs", "#logs"),
                        ("Events", "#events"),
                        ("Egress", "#audit, .empty")):  # fmt: skip
        page.click(f"role=tab[name={tab}]")
        page.wait_for_selector(marker)
        expect(loaded).to_have_count(0)
        assert overflowing(page) == [], tab
        shot(page, tmp_path, f"phone-sandbox-{tab.lower()}")
    assert page.evaluate("window.__violations") == [], "the page broke its CSP"
    context.close()
    with platform.client(platform.admin_key) as admin:
        admin.delete(f"/v1/sandboxes/{sid}")
