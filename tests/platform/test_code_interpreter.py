"""E2B's code interpreter SDK, unmodified (the pinned `e2b-code-interpreter`), against SPACE's
`code-interpreter` template: the template built from the spec SPACE ships (as `space up` does),
then `run_code` with its documented uses in a real sandbox: a matplotlib plot comes back as a
PNG and as chart data, a DataFrame as its columns, state persists between cells, output
streams, errors and env vars, contexts. And what must not work: another tenant's token, none,
and our tokens reaching the sandbox."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from e2b import Sandbox as PlainSandbox
from e2b_code_interpreter import AsyncSandbox, Sandbox
from e2b_code_interpreter.charts import (
    BarChart,
    LineChart,
    PieChart,
    ScaleType,
    ScatterChart,
    SuperChart,
)

from ..stack import Platform
from .test_e2b import opts

pytestmark = pytest.mark.vm

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def sbx(platform: Platform, code_interpreter: str) -> Iterator[Sandbox]:
    # No template named: the SDK asks for its default, `code-interpreter-v1`.
    sandbox = Sandbox.create(timeout=600, **opts(platform))
    try:
        yield sandbox
    finally:
        sandbox.kill()


def test_run_code_returns_a_plot_and_keeps_state(sbx: Sandbox) -> None:
    plot = sbx.run_code("import matplotlib.pyplot as plt; plt.plot([1, 2]); plt.show()")
    assert plot.error is None, plot.error
    (png,) = [r.png for r in plot.results if r.png]
    assert base64.b64decode(png).startswith(PNG)

    assert sbx.run_code("x = 41").error is None
    answer = sbx.run_code("x + 1")
    assert answer.text == "42" and answer.results[0].is_main_result
    assert answer.execution_count is not None and answer.execution_count >= 3

    lines: list[str] = []
    printed = sbx.run_code(
        "import sys; print('out'); print('err', file=sys.stderr)",
        on_stdout=lambda m: lines.append(m.line),
    )
    assert printed.logs.stdout == ["out\n"] and printed.logs.stderr == ["err\n"]
    assert lines == ["out\n"]

    failed = sbx.run_code("1 / 0")
    assert failed.error is not None and failed.error.name == "ZeroDivisionError"
    assert "division by zero" in failed.error.value

    env = sbx.run_code("import os; os.environ.get('TRY')", envs={"TRY": "given"})
    assert env.text == "'given'"
    assert sbx.run_code("import os; os.environ.get('TRY')").text is None  # only for that cell

    # The kernel is in the sandbox: what it writes, the sandbox's files show.
    sbx.run_code("open('/tmp/from-kernel', 'w').write('k')")
    assert sbx.files.read("/tmp/from-kernel") == "k"


def test_charts_and_dataframes_come_back_as_data(sbx: Sandbox) -> None:
    def chart(code: str) -> Any:
        done = sbx.run_code(f"import matplotlib.pyplot as plt\n{code}\nplt.show()")
        assert done.error is None and not done.logs.stderr, (done.error, done.logs.stderr)
        (result,) = done.results
        assert result.png, result.formats()  # the picture too
        return result.chart

    line = chart("plt.plot([1, 2, 3], [4, 5, 6.5], label='up'); plt.title('T'); plt.xlabel('x')")
    assert isinstance(line, LineChart), line
    assert (line.title, line.x_label, line.x_scale) == ("T", "x", ScaleType.LINEAR)
    assert [(e.label, e.points) for e in line.elements] == [("up", [(1, 4), (2, 5), (3, 6.5)])]
    assert line.x_ticks and len(line.x_ticks) == len(line.x_tick_labels)

    bars = chart("plt.bar(['a', 'b'], [3, 5])")
    assert isinstance(bars, BarChart), bars
    assert [(e.label, e.value) for e in bars.elements] == [("a", 3), ("b", 5)]

    sideways = chart("plt.barh(['p', 'q'], [2, 7])")
    assert [(e.label, e.value) for e in sideways.elements] == [("p", 2), ("q", 7)]

    pie = chart("plt.pie([1, 3], labels=['x', 'y'])")
    assert isinstance(pie, PieChart), pie
    assert [(e.label, round(e.angle)) for e in pie.elements] == [("x", 90), ("y", 270)]

    dots = chart("plt.scatter([1, 2], [3, 4])")
    assert isinstance(dots, ScatterChart) and dots.elements[0].points == [(1, 3), (2, 4)]
    gap = chart("plt.scatter([1, 2, 3], [1, float('nan'), 3])")  # no warning in the output
    named = chart("plt.scatter(['a', 'b', 'c'], [1, float('nan'), 3])")  # and on categories
    assert named.x_scale == ScaleType.CATEGORICAL and named.elements[0].points[0] == ("a", 1)
    first, missing, last = gap.elements[0].points
    assert (first, missing[1], last) == ((1, 1), None, (3, 3)), gap.elements[0].points

    both = chart("_, (a, b) = plt.subplots(1, 2); a.plot([1, 2]); b.bar(['c'], [1])")
    assert isinstance(both, SuperChart), both
    assert [type(c) for c in both.elements] == [LineChart, BarChart]

    assert chart("plt.imshow([[0, 1], [1, 0]])") is None  # an image: only the picture

    frame = sbx.run_code(
        "import pandas as pd\npd.DataFrame({'a': [1, 2, 3], 'b': ['x', 'y', None]})"
    )
    (result,) = frame.results
    assert result.data == {"a": [1, 2, 3], "b": ["x", "y", None]}, result.data
    assert result.html and result.is_main_result
    exact = sbx.run_code(
        "pd.DataFrame({'f': [0.1 + 0.2], 't': [pd.Timestamp('2026-01-02 03:04:05.123456')]})"
    )
    assert exact.results[0].data == {
        "f": [0.30000000000000004],
        "t": ["2026-01-02T03:04:05.123456"],
    }
    nested = sbx.run_code("pd.DataFrame({'l': [[1, 2]], 'o': [{'k': 1.5}]})").results[0]
    assert nested.data == {"l": [[1, 2]], "o": [{"k": 1.5}]}, nested.data
    clash = sbx.run_code("pd.DataFrame({1: [1], '1': [2]})").results[0]
    assert clash.data is None and clash.text  # two columns would be one in JSON
    big = sbx.run_code("import numpy as np\npd.DataFrame(np.zeros((1000, 200)))").results[0]
    assert big.data is None and big.text  # past 100,000 values: its usual displays only

    # Every context's kernel makes them, not only the default one.
    ctx = sbx.create_code_context()
    other = sbx.run_code("import pandas as pd\npd.DataFrame({'n': [1.5]})", context=ctx)
    assert other.results[0].data == {"n": [1.5]}


def test_contexts_hold_state_of_their_own(sbx: Sandbox) -> None:
    sbx.run_code("shared = 'default'")
    ctx = sbx.create_code_context(cwd="/tmp")
    assert ctx.language == "python" and ctx.cwd == "/tmp"
    assert ctx.id in {c.id for c in sbx.list_code_contexts()}
    assert sbx.run_code("import os; os.getcwd()", context=ctx).text == "'/tmp'"
    assert sbx.run_code("'shared' in dir()", context=ctx).text == "False"
    sbx.run_code("mine = 1", context=ctx)
    sbx.restart_code_context(ctx)
    assert sbx.run_code("'mine' in dir()", context=ctx).text == "False"
    sbx.remove_code_context(ctx)
    assert ctx.id not in {c.id for c in sbx.list_code_contexts()}
    assert sbx.run_code("shared").text == "'default'"

    with pytest.raises(Exception, match="not in this template"):
        sbx.run_code("1", language="r")


def test_a_cell_whose_caller_left_is_interrupted(platform: Platform, sbx: Sandbox) -> None:
    endless = "import time\nwhile True: time.sleep(0.1)"
    # A client that hangs up: its cell is interrupted at once, and the context is free.
    head = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49999",
            "E2B-Traffic-Access-Token": sbx.traffic_access_token or ""}  # fmt: skip
    with pytest.raises(httpx.ReadTimeout), httpx.stream(
        "POST", f"{platform.api_url}/e2b/envd/execute", json={"code": endless}, headers=head,
        timeout=httpx.Timeout(3.0),
    ) as r:  # fmt: skip
        for _ in r.iter_lines():
            pass
    left = time.monotonic()
    assert sbx.run_code("'free'").text == "'free'"
    assert time.monotonic() - left < 15

    # The SDK's own deadline (its transport enforces it in its own time) ends the same way.
    with pytest.raises(Exception, match="timed out"):
        sbx.run_code(endless, timeout=3)
    assert sbx.run_code("'free again'").text == "'free again'"


async def test_the_async_sdk(platform: Platform, code_interpreter: str) -> None:
    sandbox = await AsyncSandbox.create(timeout=600, **opts(platform))
    try:
        done = await sandbox.run_code("sum(range(10))")
        assert done.text == "45"
    finally:
        await sandbox.kill()


def test_ports_need_the_sandboxs_own_token_which_never_reaches_it(
    platform: Platform, sbx: Sandbox
) -> None:
    url = f"{platform.api_url}/e2b/envd/execute"
    head = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49999"}
    assert sbx.traffic_access_token

    def execute(**more: str) -> httpx.Response:
        return httpx.post(url, json={"code": "1"}, headers={**head, **more})

    ok = execute(**{"E2B-Traffic-Access-Token": sbx.traffic_access_token})
    assert ok.status_code == 200 and '"end_of_execution"' in ok.text

    # None; the envd token in its place; another tenant's; an altered one.
    other = PlainSandbox.create("base", timeout=120, **opts(platform, platform.key_b))
    try:
        theirs = other.traffic_access_token or ""
        refused = [
            execute(),
            execute(**{"X-Access-Token": sbx._envd_access_token or ""}),
            execute(**{"E2B-Traffic-Access-Token": theirs}),
            execute(**{"E2B-Traffic-Access-Token": sbx.traffic_access_token[:-2] + "AA"}),
        ]
        assert [r.status_code for r in refused] == [401] * 4, [r.text for r in refused]
        # Nor does the other tenant's token open this sandbox at its own preview host.
        host = f"49999-{sbx.sandbox_id}.localhost"
        r = httpx.post(f"{platform.api_url}/execute", json={"code": "1"},
                       headers={"Host": host, "E2B-Traffic-Access-Token": theirs})  # fmt: skip
        assert r.status_code == 401, r.text
    finally:
        other.kill()

    # A service in the sandbox sees the request, never the tokens that let it in.
    sbx.commands.run(ECHO, background=True)
    sbx.commands.run("for i in $(seq 100); do test -e /tmp/echo-up && break; sleep 0.1; done")
    seen = httpx.get(f"{platform.api_url}/e2b/envd/sp%20ace/x%3Fy?q=1", headers={
        "E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8123", "X-Access-Token": "x",
        "E2B-Traffic-Access-Token": sbx.traffic_access_token, "X-Mine": "kept"})  # fmt: skip
    assert seen.status_code == 200, seen.text
    echoed = json.loads(seen.text)
    assert echoed["PATH"] == "/sp%20ace/x%3Fy?q=1"  # the path as the client wrote it
    headers = {k.lower() for k in echoed}
    assert "x-mine" in headers
    assert not headers & {"x-access-token", "e2b-traffic-access-token", "authorization"}


ECHO = """python3 -c '
import http.server, json, pathlib
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({**self.headers, "PATH": self.path}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body)))
        self.end_headers(); self.wfile.write(body)
s = http.server.HTTPServer(("127.0.0.1", 8123), H)
pathlib.Path("/tmp/echo-up").touch()
s.serve_forever()'"""
