"""Errors as JSON a client can act on: `{"error": "<what is wrong>", "detail": [...]}`.

Bad input is always a 4xx naming the field; a 500 means a bug in this project, never the caller's fault.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("services.errors")


class ApiError(Exception):
    """Raised by routes and cores to answer with a given status and message."""

    def __init__(self, status_code: int, message: str, **detail: object) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.detail = detail


def _field_path(loc: tuple | list, kind: str = "") -> str:
    if kind == "json_invalid":
        return "body"
    # Drop the "body"/"query" prefix so the message names the field as the caller wrote it.
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    return ".".join(parts) or "body"


def _message(error: dict) -> str:
    if error.get("type") == "model_attributes_type" and tuple(error.get("loc", ())) == ("body",):
        return "expected a JSON object (send Content-Type: application/json)"
    if error.get("type") == "json_invalid":
        return f"invalid JSON ({error.get('ctx', {}).get('error', 'cannot parse')})"
    return error.get("msg", "invalid")


def describe_validation_errors(errors: list[dict]) -> str:
    return "; ".join(f"{_field_path(e.get('loc', ()), e.get('type', ''))}: {_message(e)}" for e in errors)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = [
            {
                "field": _field_path(e.get("loc", ()), e.get("type", "")),
                "msg": _message(e),
                "type": e.get("type"),
            }
            for e in exc.errors()
        ]
        return JSONResponse(
            status_code=422,
            content={
                "error": f"invalid request: {describe_validation_errors(exc.errors())}",
                "detail": errors,
            },
        )

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(status_code=exc.status_code, content={"error": exc.message, **exc.detail})

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return JSONResponse(status_code=exc.status_code, content={"error": message}, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", extra={"path": request.url.path})
        return JSONResponse(status_code=500, content={"error": f"internal error: {type(exc).__name__}"})
