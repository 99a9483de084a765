"""A drop-in for E2B: its unmodified SDKs work against SPACE (`app`: the REST API they call,
`envd`: their sandbox's daemon, answered here)."""
