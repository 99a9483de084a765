"""The web console's built files (`static/`, made by `make console` from `console/`)."""

from pathlib import Path

STATIC = Path(__file__).resolve().parent / "static"
