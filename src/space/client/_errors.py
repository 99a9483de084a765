"""The SDK's exceptions: one base class, one subclass per way a call can fail.

Answers with an error status are `application/problem+json`; `error_from_response` turns one into
the matching `APIError` subclass. Transport failures (refused connection, timeout, a dropped
stream) become `ConnectionError`, so a caller never has to catch httpx's own exceptions.
"""

from __future__ import annotations

import builtins
import contextlib
import json
from collections.abc import Iterator, Mapping
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx  # only for annotations: the CLI's own errors and its --help need no HTTP stack


class SpaceError(Exception):
    """Base class of every error the SDK raises."""


class ConnectionError(SpaceError, builtins.ConnectionError):
    """The API could not be reached, or the connection broke during a call.

    It is also a builtin `ConnectionError`, so code written against the standard exceptions
    catches it too.
    """


class ExecError(SpaceError):
    """A command could not be run, or its run failed without an exit status (e.g. the sandbox's
    agent was lost); `code` is the machine-readable reason."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"exec failed ({code}): {message}")
        self.code = code
        self.message = message


class APIError(SpaceError):
    """The API answered with an error status; `body` is its problem+json document."""

    hint = ""

    def __init__(self, status: int, title: str, detail: str, body: Mapping[str, Any]) -> None:
        self.status = status
        self.title = title
        self.detail = detail
        self.body = body
        super().__init__(self._message())

    def _message(self) -> str:
        text = f"{self.status} {self.title}"
        if self.detail and self.detail != self.title:
            text += f": {self.detail}"
        return f"{text} ({self.hint})" if self.hint else text


class AuthenticationError(APIError):
    """401: the API key is missing, malformed, revoked or for another server."""

    hint = "check SPACE_API_KEY or the credentials file that `space up` writes"


class NotFoundError(APIError):
    """404: no such sandbox (or it belongs to another tenant), file or route."""


class ConflictError(APIError):
    """409: the sandbox is not in a state that allows the call; `state` is the state it is in."""

    @property
    def state(self) -> str | None:
        state = self.body.get("state")
        return state if isinstance(state, str) else None


class ValidationError(APIError):
    """400/422: the request was malformed; `errors` says which fields and why."""

    @property
    def errors(self) -> list[dict[str, Any]]:
        errors = self.body.get("errors")
        return [e for e in errors if isinstance(e, dict)] if isinstance(errors, list) else []

    def _message(self) -> str:
        problems = "; ".join(
            ".".join(str(part) for part in e.get("loc", [])) + f": {e.get('msg', '?')}"
            for e in self.errors
        )
        # SPACE's own detail already lists the problems; other servers' may not.
        if problems and problems not in self.detail:
            return f"{super()._message()} ({problems})"
        return super()._message()


_BY_STATUS: dict[int, type[APIError]] = {
    400: ValidationError,
    401: AuthenticationError,
    404: NotFoundError,
    409: ConflictError,
    422: ValidationError,
}


def error_from_response(response: httpx.Response) -> APIError:
    """The exception for an error answer whose body has been read."""
    try:
        body = json.loads(response.content)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        # Not problem+json (a proxy's error page, say): its text is the best detail there is.
        body = {"detail": response.text.strip()[:500]}
    return error_from_problem(response.status_code, body)


def error_from_problem(status: int, body: Mapping[str, Any]) -> APIError:
    """The exception for a status and a problem document (which may lack any field)."""
    title = body.get("title")
    if not isinstance(title, str) or not title:
        try:
            title = HTTPStatus(status).phrase
        except ValueError:
            title = "Error"
    detail = body.get("detail") or ""
    if not isinstance(detail, str):
        detail = json.dumps(detail)
    return _BY_STATUS.get(status, APIError)(status, title, detail, body)


@contextlib.contextmanager
def transport_errors(base_url: httpx.URL | str) -> Iterator[None]:
    """Turns httpx's transport exceptions raised inside the block into our ConnectionError."""
    import httpx

    try:
        yield
    except httpx.TimeoutException as e:
        raise ConnectionError(f"the SPACE API at {base_url} did not answer in time ({e!r})") from e
    except httpx.TransportError as e:
        raise ConnectionError(
            f"cannot talk to the SPACE API at {base_url}: {e or type(e).__name__} "
            "(is it running? `space up` starts one; SPACE_API_URL or --api-url says where it is)"
        ) from e
