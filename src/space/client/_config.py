"""Where the SDK and the CLI find the API's address and key.

Each setting is taken from the first place that has it: the explicit argument, the environment
(SPACE_API_URL, SPACE_API_KEY), then the credentials file that `space up` writes,
`$XDG_CONFIG_HOME/space/credentials.json` (by default `~/.config/space/credentials.json`). The
address falls back to the local default; a key has no default.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from space.client._errors import SpaceError

DEFAULT_API_URL = "http://127.0.0.1:8080"
URL_VARIABLE = "SPACE_API_URL"
KEY_VARIABLE = "SPACE_API_KEY"


@dataclass(frozen=True)
class Credentials:
    api_url: str
    api_key: str


def credentials_path() -> Path:
    config_home = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(config_home) / "space" / "credentials.json"


def _read_file(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise SpaceError(f"cannot read the credentials file {path}: {e}") from e
    if not isinstance(data, dict):
        raise SpaceError(f"the credentials file {path} is not a JSON object")
    return {k: v for k, v in data.items() if k in ("api_url", "api_key") and isinstance(v, str)}


def resolve_credentials(api_url: str | None = None, api_key: str | None = None) -> Credentials:
    """The API's address and key; raises SpaceError, saying where to put a key, if none is found."""
    url = api_url or os.environ.get(URL_VARIABLE)
    key = api_key or os.environ.get(KEY_VARIABLE)
    path = credentials_path()
    # The file is only read when something is still missing, so a broken one cannot get in
    # the way of explicit settings.
    saved = _read_file(path) if not (url and key) else {}
    url = url or saved.get("api_url") or DEFAULT_API_URL
    key = key or saved.get("api_key")
    if not key:
        raise SpaceError(
            f"no SPACE API key: pass one (api_key= or --api-key), set {KEY_VARIABLE}, "
            f"or run `space up`, which writes {path}"
        )
    return Credentials(url, key)


def resolve_api_url(api_url: str | None = None) -> str:
    """The API's address alone (for what brings its keys with each request)."""
    found = api_url or os.environ.get(URL_VARIABLE)
    return found or _read_file(credentials_path()).get("api_url") or DEFAULT_API_URL


def save_credentials(credentials: Credentials) -> Path:
    """Writes the credentials file (readable by its owner only) in one step; returns its path."""
    import tempfile  # only here: every CLI command reads this module, few of them write

    path = credentials_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".credentials.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"api_url": credentials.api_url, "api_key": credentials.api_key}, f)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path
