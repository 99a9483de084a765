"""Print the OpenAPI document (checked in as docs/openapi.json): `python -m space.api.openapi`."""

from __future__ import annotations

import sys

from space.api.app import openapi_document

if __name__ == "__main__":
    sys.stdout.write(openapi_document())
