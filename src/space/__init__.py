"""SPACE: a self-hostable Sandboxed Platform for Agentic Code Execution."""

__version__ = "0.1.0"
