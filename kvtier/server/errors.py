"""Errors in the OpenAI shape, ``{"error": {"message", "type", "code", "param"}}``, for every failure.

OpenAI clients read that body to raise a typed exception with the server's
message, so every path that ends a request early answers with it: our own
:class:`APIError`, FastAPI's validation errors (422, malformed JSON
included), Starlette's 404/405, and the last-resort 500, which logs the
traceback and tells the client nothing about the internals.
"""

from __future__ import annotations

import enum
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)


class ErrorType(enum.StrEnum):
    INVALID_REQUEST = "invalid_request_error"
    AUTHENTICATION = "authentication_error"
    NOT_FOUND = "not_found_error"
    SERVER = "server_error"
    UNAVAILABLE = "service_unavailable"


class ErrorCode(enum.StrEnum):
    INVALID_API_KEY = "invalid_api_key"
    MODEL_NOT_FOUND = "model_not_found"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    MAX_TOKENS_TOO_LARGE = "max_tokens_too_large"
    REQUEST_TOO_LARGE = "request_too_large"
    INVALID_PROMPT = "invalid_prompt"
    INVALID_REQUEST = "invalid_request"
    UNKNOWN_TENANT = "unknown_tenant"
    NOT_FOUND = "not_found"
    INTERNAL = "internal_error"
    SHUTTING_DOWN = "shutting_down"


class APIError(Exception):
    """A failure with an HTTP status and an OpenAI error body; raise it anywhere in a handler."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: ErrorType = ErrorType.INVALID_REQUEST,
        code: ErrorCode | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.type.value, "code": self.code, "param": self.param}}

    def response(self, request: Request | None = None) -> JSONResponse:
        """The OpenAI shape, or (``request`` on the Messages API) Anthropic's: ``{"type": "error", "error": ...}``."""
        if request is None or not speaks_messages(request):
            return JSONResponse(self.body(), status_code=self.status, headers=self.headers)
        kind = MESSAGES_ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")
        body = {"type": "error", "error": {"type": kind, "message": self.message}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


MESSAGES_PATH = "/v1/messages"
MESSAGES_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
"""The Messages API's error types by status (its clients raise by status and show the message)."""


def speaks_messages(request: Request) -> bool:
    """A request to the Messages API, which answers errors in its own shape (and a malformed body with 400)."""
    return request.url.path == MESSAGES_PATH or request.url.path.startswith(MESSAGES_PATH + "/")


def unauthorized(message: str) -> APIError:
    return APIError(
        401,
        message,
        type=ErrorType.AUTHENTICATION,
        code=ErrorCode.INVALID_API_KEY,
        headers={"WWW-Authenticate": "Bearer"},
    )


def _where(loc: tuple[int | str, ...]) -> str:
    """A field's path as a client wrote it: names and indices, without pydantic's union-branch tags."""
    return ".".join(str(p) for p in loc if p != "body" and (isinstance(p, int) or str(p).isidentifier()))


def _is_type_error(e: dict) -> bool:
    return str(e.get("type", "")).endswith("_type")


def _ancestors(where: str) -> list[str]:
    parts = where.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _relevant(errors: list[dict]) -> list[dict]:
    """For a field given as one branch of a union (``stop``: a string or a list), the branch it was written as.

    Pydantic reports every branch; "Input should be a valid string" beside
    "List should have at most 4 items" would only hide the real limit. A
    type mismatch at a field is dropped when another error sits at the same
    field or inside it: the client wrote that other shape. Linear in the
    errors, since one body can carry many thousands.
    """
    wheres = [_where(e.get("loc", ())) for e in errors]
    other_shape = {w for w, e in zip(wheres, errors, strict=True) if not _is_type_error(e)}
    other_shape.update(a for w in wheres for a in _ancestors(w))
    return [e for w, e in zip(wheres, errors, strict=True) if not (_is_type_error(e) and w in other_shape)]


def _validation_message(err: RequestValidationError) -> tuple[str, str | None]:
    """One line per problem, naming the field; input values are never echoed back."""
    parts, first = [], None
    for e in _relevant(list(err.errors()))[:8]:
        if e.get("type") == "json_invalid":
            reason = (e.get("ctx") or {}).get("error", "invalid JSON")
            return f"the request body is not valid JSON ({reason} at character {e['loc'][-1]})", None
        where = _where(e.get("loc", ()))
        first = first or where or None
        parts.append(f"{where}: {e.get('msg', 'invalid')}" if where else str(e.get("msg", "invalid")))
    return "; ".join(dict.fromkeys(parts)) or "invalid request", first


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response(request)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    message, param = _validation_message(exc)
    status = 400 if speaks_messages(request) else 422  # the Messages API answers a malformed request with 400
    return APIError(status, message, code=ErrorCode.INVALID_REQUEST, param=param).response(request)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    kind = ErrorType.NOT_FOUND if exc.status_code == 404 else ErrorType.INVALID_REQUEST
    code = ErrorCode.NOT_FOUND if exc.status_code == 404 else ErrorCode.INVALID_REQUEST
    error = APIError(exc.status_code, str(exc.detail), type=kind, code=code, headers=exc.headers)
    return error.response(request)


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return APIError(500, "internal server error", type=ErrorType.SERVER, code=ErrorCode.INTERNAL).response(request)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
