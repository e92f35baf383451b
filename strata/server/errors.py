"""HTTP errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, for every error
the server gives (its own, Starlette's 404/405, and an unexpected exception's 500)."""

from __future__ import annotations

import logging
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from strata.server.protocol import Failed

log = logging.getLogger("strata.serve")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "server_error", 503: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error" if self.status >= 500 else
                          "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def headers(self) -> dict[str, str]:
        h = {}
        if self.retry_after is not None:
            h["Retry-After"] = str(max(1, round(self.retry_after)))
        if self.status == 401:
            h["WWW-Authenticate"] = "Bearer"
        return h


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


GONE = APIError(499, "the client closed the connection", code="client_closed_request")


def as_error(ev: object) -> APIError:
    """An engine's Failed message (or an APIError already) as the error to answer."""
    if isinstance(ev, Failed):
        return APIError(ev.status, ev.message, ev.param, ev.code)
    if isinstance(ev, APIError):
        return ev
    return APIError(500, f"unexpected engine message {type(ev).__name__}")


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers())


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        msg = f"no such path: {request.method} {request.url.path}"
    elif exc.status_code == 405:
        msg = f"{request.method} is not allowed on {request.url.path}"
    else:
        msg = str(exc.detail)
    return error_response(APIError(exc.status_code, msg, code=f"http_{exc.status_code}"))


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("internal error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(APIError(500, f"internal server error: {type(exc).__name__}: {exc}"))


EXCEPTION_HANDLERS: dict[Any, Any] = {
    APIError: _api_error, HTTPException: _http_error, Exception: _internal_error}
