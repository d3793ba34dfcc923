"""Errors as JSON a client can act on: `{"error": "<what is wrong>", "detail": [...]}`.

Bad input is always a 4xx naming the field; a 500 means a bug in this project, never the caller's fault.
"""

from __future__ import annotations

import logging

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("services.errors")

CLIPPED_CHARS = 80


def clip(text: str, limit: int = CLIPPED_CHARS) -> str:
    """A caller's string for an error message: repr'd, and cut so a 15 MB name is not echoed back whole."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"


class FieldProblem(BaseModel):
    field: str = Field(description="The offending field as the caller wrote it, e.g. items.3.response.")
    msg: str
    type: str | None = Field(None, description="pydantic's error type, e.g. missing, string_type.")


class ErrorResponse(BaseModel):
    """The body of every 4xx/5xx answer."""

    model_config = ConfigDict(extra="allow")

    error: str = Field(description="What is wrong, naming the field or limit, in one line.")
    detail: list[FieldProblem] | None = Field(None, description="One entry per invalid field (422 only).")


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


ERROR_STATUS_TEXT = {
    400: "The body is not readable (broken Content-Length, bytes that are not text).",
    401: "Missing or wrong bearer token.",
    404: "No such dataset / split (the message lists what exists).",
    409: "The request conflicts with the data it names (e.g. a batch larger than its split).",
    413: "The request is over a size limit (body bytes, items, queries or string length); the message "
    "names the limit.",
    422: "A field is missing, of the wrong type or out of range; `detail` names each one.",
    499: "The client closed the connection before the answer was ready (nobody receives this).",
    503: "The service is still loading, saturated, or shutting down; retry later.",
}


def document_errors(schema: dict, auth: bool) -> dict:
    """Make the OpenAPI document say what the error bodies are (ErrorResponse, not FastAPI's
    HTTPValidationError) and which statuses each operation may answer, so a schema-driven client or
    fuzzer can hold the service to it. Operations list extra statuses via `responses=` on the route."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components.pop("HTTPValidationError", None)
    components.pop("ValidationError", None)
    components["ErrorResponse"] = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(components["ErrorResponse"].pop("$defs", {}))
    ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, operations in schema.get("paths", {}).items():
        if path == "/health":  # documents its own 503 (a health body, not an error)
            continue
        for method, operation in operations.items():
            responses = operation.setdefault("responses", {})
            statuses = {401} if auth else set()
            if path != "/metrics":
                statuses |= {422, 503}
            if method in ("post", "put", "patch"):
                statuses |= {400, 413}
            for status in sorted(statuses | {int(s) for s in responses if s.isdigit() and int(s) >= 400}):
                responses[str(status)] = {
                    "description": ERROR_STATUS_TEXT.get(status, "Error"),
                    "content": {"application/json": {"schema": ref}},
                }
    if auth:
        schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        schema["security"] = [{"bearer": []}]
        schema["paths"]["/health"]["get"]["security"] = []
    return schema


MAX_REPORTED_ERRORS = 20  # a batch of 4096 bad items should not produce a 4096-line message


def load_json(body: bytes):
    """Parse a body the route reads itself, or raise the 422 FastAPI would give. orjson also refuses
    lone surrogates, which a tokenizer or a JSON encoder would choke on later."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise RequestValidationError(
            [
                {
                    "type": "json_invalid",
                    "loc": ("body",),
                    "msg": "JSON decode error",
                    "ctx": {"error": str(exc)},
                }
            ]
        ) from None


def body_errors(exc: ValidationError) -> RequestValidationError:
    """pydantic's errors for a body the route validated itself, as FastAPI's 422 (fields as sent)."""
    errors = exc.errors(include_url=False, include_input=False, include_context=False)
    return RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in errors[:MAX_REPORTED_ERRORS]])
