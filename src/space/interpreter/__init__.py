"""The `code-interpreter` template's service: stateful code execution in Jupyter kernels,
answered on port 49999 in the guest with the endpoints E2B's `e2b-code-interpreter` SDK calls
(`/execute` streams a cell's output as JSON lines; `/contexts` makes, lists, restarts and
removes kernels).

It runs inside the sandbox, on the template's own python3 with Debian's tornado and
jupyter_client (`space image code-interpreter` puts this package into the image); the platform
never imports it. Its callers reach it through the API's ingress like any sandbox port.
"""

from pathlib import Path

PORT = 49999
SPEC = Path(__file__).parent / "space.toml"  # the template's spec (`space template build -f`)
