"""What every bench does with its results: the JSON on stdout, and into a file if asked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(results: dict[str, Any], path: str | Path | None) -> None:
    text = json.dumps(results, indent=2, default=str)
    print(text)
    if path:
        Path(path).write_text(text + "\n")
