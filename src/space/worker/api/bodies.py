"""Request bodies of the worker API: read within a cap, checked against the wire models, and
refused as problem+json naming what was wrong."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from space.release import HEADER, newer
from space.worker.api.models import MAX_CONTEXT_B64

MAX_JSON_BODY = MAX_CONTEXT_B64 + (1 << 20)  # the largest body a call takes: a build context


class Problem(Exception):
    """An answer other than success, as problem+json."""

    def __init__(self, status: int, detail: str, **extra: Any) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.extra = extra


M = TypeVar("M", bound=BaseModel)


def parse(model: type[M], raw: bytes | str, newer_sender: bool = False) -> M:
    """`raw` as `model`. From a newer release, members this one does not know are left out
    (a release adds only members its predecessor may ignore); from any other, refused."""
    try:
        if newer_sender:
            data = json.loads(raw)
            if isinstance(data, dict):
                known = {f.alias or name for name, f in model.model_fields.items()}
                raw = json.dumps({k: v for k, v in data.items() if k in known})
        return model.model_validate_json(raw)
    except ValueError as e:
        if not isinstance(e, ValidationError):
            raise Problem(400, f"invalid request body: {e}") from None
        errors = [
            {"loc": ".".join(str(x) for x in err["loc"]) or "body", "msg": err["msg"]}
            for err in e.errors(include_url=False)
        ]
        detail = "; ".join(f"{x['loc']}: {x['msg']}" for x in errors)
        raise Problem(400, f"invalid request body: {detail}", errors=errors) from None


async def read_body(model: type[M], request: Request) -> M:
    """The request's JSON body as `model`; one over MAX_JSON_BODY is refused unread (413)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_JSON_BODY:
        raise Problem(413, f"a body of {declared} bytes is over {MAX_JSON_BODY} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_JSON_BODY:
            raise Problem(413, f"a body over {MAX_JSON_BODY} bytes")
    return parse(model, bytes(body) or b"{}", newer(request.headers.get(HEADER)))
