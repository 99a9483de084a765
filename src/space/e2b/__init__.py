"""A drop-in for E2B: its unmodified SDKs work against SPACE (`app`: the REST API they call,
`envd`: their sandbox's daemon, answered here)."""

PREFIX = "/e2b"  # where the API mounts it
ENVD_PATH = f"{PREFIX}/envd"
ENVD_PORT = 49983  # the daemon's port in E2B's host names, `49983-{sandbox}.{domain}`
