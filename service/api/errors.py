"""The service's errors: each carries its HTTP status; one handler renders them all alike, and every
other failure (a database outage, a bug, in a route or in middleware) is rendered the same way."""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.api.values import escaped
from service.storage.errors import DATABASE_ERROR_TYPES, is_transient

logger = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 5  # a 503's Retry-After: about how long a database or engine restart takes
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class FieldError(BaseModel):
    """One problem of the request: where (`loc`, e.g. ["body", "metadata", "foo", 2]) and what."""

    loc: list[str | int] = Field(description="body, query, path or header, then field names and indices.")
    msg: str
    type: str = Field(description="A machine-readable kind, e.g. int_type, missing, lone_surrogate.")


class ErrorBody(BaseModel):
    """Every 4xx/5xx answer: `detail` says what is wrong; `errors` lists field problems."""

    detail: str
    errors: list[FieldError] = []


class ServiceError(Exception):
    status_code = 500
    description = "Internal error"
    retry_after_seconds: int | None = None  # set: the answer carries Retry-After (retry, not a bug)

    def __init__(self, detail: str, errors: list[dict[str, Any]] | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.errors = errors or []


class NotFound(ServiceError):
    status_code = 404
    description = "Not found"


class Conflict(ServiceError):
    status_code = 409
    description = "Conflicts with what is stored"


class InvalidRequest(ServiceError):
    status_code = 422
    description = "Invalid request: `detail` and `errors` name each field and its problem"

    @classmethod
    def field(cls, location: list[str | int], message: str, kind: str = "value_error") -> InvalidRequest:
        return cls(
            f"{field_path(location)}: {message}", [{"loc": ["body", *location], "msg": message, "type": kind}]
        )


class BodyUnparseable(ServiceError):
    status_code = 400
    description = "The body is not JSON text: not UTF-8, or nested too deeply to parse"


class PayloadTooLarge(ServiceError):
    status_code = 413
    description = "Request body too large"


class Unauthorized(ServiceError):
    status_code = 401
    description = "Missing or wrong API key (when API_KEYS is set)"


class Forbidden(ServiceError):
    status_code = 403
    description = "An admin key's operation (API_KEYS); a project key (API_PROJECTS) may not"


class NotReady(ServiceError):
    status_code = 503
    description = "A dependency is unreachable"
    retry_after_seconds = RETRY_AFTER_SECONDS


class DatabaseUnavailable(ServiceError):
    status_code = 503
    description = "The database is unreachable or overloaded: retry after Retry-After seconds"
    retry_after_seconds = RETRY_AFTER_SECONDS


def field_path(location: Sequence[str | int]) -> str:
    """A location as one readable path: metadata.foo[2], metadata["a b"], sampling_params.stop[0]."""
    path = ""
    for part in location:
        if isinstance(part, int):
            path += f"[{part}]"
        elif _NAME.match(part):
            path += f".{part}" if path else part
        else:
            path += '["' + escaped(part).replace('"', '\\"') + '"]'
    return path or "body"


def _headers(error: type[ServiceError]) -> dict[str, Any]:
    headers: dict[str, Any] = {}
    if error.retry_after_seconds is not None:
        headers["Retry-After"] = {
            "description": "Seconds to wait before retrying.",
            "schema": {"type": "integer"},
        }
    if issubclass(error, Unauthorized):
        headers["WWW-Authenticate"] = {"description": "Bearer", "schema": {"type": "string"}}
    return headers


def responses(*errors: type[ServiceError]) -> dict[int | str, dict[str, Any]]:
    """The `responses=` entry of a route that may raise these errors (those of one status: one entry)."""
    documented: dict[int | str, dict[str, Any]] = {}
    for error in errors:
        entry = documented.setdefault(error.status_code, {"model": ErrorBody, "description": ""})
        entry["description"] = "; or ".join(filter(None, [entry["description"], error.description]))
        if headers := _headers(error):
            entry["headers"] = entry.get("headers", {}) | headers
    return documented


def error_headers(error: ServiceError) -> dict[str, str]:
    headers = {"WWW-Authenticate": "Bearer"} if isinstance(error, Unauthorized) else {}
    if error.retry_after_seconds is not None:
        headers["Retry-After"] = str(error.retry_after_seconds)
    return headers


def error_body(error: ServiceError) -> ErrorBody:
    problems = [
        FieldError(
            # A key of the request may hold a lone surrogate, which no JSON answer can encode.
            loc=[escaped(part) if isinstance(part, str) else part for part in problem.get("loc", [])],
            msg=escaped(str(problem.get("msg", ""))),
            type=str(problem.get("type", "value_error")),
        )
        for problem in error.errors
    ]
    return ErrorBody(detail=escaped(error.detail), errors=problems)


def error_response(error: ServiceError) -> JSONResponse:
    return JSONResponse(
        error_body(error).model_dump(), status_code=error.status_code, headers=error_headers(error)
    )


def _validation_message(item: dict[str, Any]) -> str:
    message = str(item["msg"])
    if item["type"] == "json_invalid" and "error" in item.get("ctx", {}):
        return f"{message}: {item['ctx']['error']} at character {item['loc'][-1]}"
    return message


def _unparseable(cause: BaseException) -> BodyUnparseable:
    """What FastAPI's "There was an error parsing the body" was (the JSON parser's error)."""
    if isinstance(cause, UnicodeDecodeError):
        message = f"not UTF-8: {cause.reason} at byte {cause.start}"
    elif isinstance(cause, RecursionError):
        message = "nested too deeply to parse"
    else:
        message = f"not JSON: {cause}"
    return BodyUnparseable(
        f"request body {message}", [{"loc": ["body"], "msg": message, "type": "body_unparseable"}]
    )


async def _handle_service_error(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, ServiceError)
    return error_response(error)


def _not_json(item: dict[str, Any], content_type: str | None) -> bool:
    """FastAPI read a body sent without a JSON content type as text, which no model takes."""
    return (
        tuple(item["loc"]) == ("body",)
        and item["type"] in ("model_attributes_type", "dict_type")
        and "json" not in (content_type or "").lower()
    )


def invalid_request(error: RequestValidationError, content_type: str | None = None) -> InvalidRequest:
    """FastAPI's validation error as the service's, each problem named by its field; `content_type`
    the request's (a body without a JSON one is told to send JSON)."""
    problems = [
        {
            "loc": list(item["loc"]),
            "msg": (
                f"send JSON: the body must be a JSON object with Content-Type: application/json "
                f"(it came as {content_type or 'no content type'})"
                if _not_json(item, content_type)
                else _validation_message(item)
            ),
            "type": item["type"],
        }
        for item in error.errors()
    ]
    summary = "; ".join(f"{_where(item)}: {item['msg']}" for item in problems)
    return InvalidRequest(summary, problems)


async def _handle_validation_error(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, RequestValidationError)
    return error_response(invalid_request(error, request.headers.get("content-type")))


def _where(problem: dict[str, Any]) -> str:
    if problem["type"] == "json_invalid":  # its location is a character of the body, not a field
        return "body"
    return field_path([part for part in problem["loc"] if part != "body"])


async def _handle_http_exception(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, StarletteHTTPException)
    if error.status_code == 400 and error.__cause__ is not None:  # FastAPI's, raised from the parser's
        return error_response(_unparseable(error.__cause__))
    body = ErrorBody(detail=str(error.detail))
    return JSONResponse(body.model_dump(), status_code=error.status_code, headers=error.headers)


def _failure(request: Request, error: Exception) -> ServiceError:
    if is_transient(error):
        logger.warning(
            "%s %s: the database is unavailable: %s: %s", request.method, request.url.path,
            type(error).__name__, error,
        )  # fmt: skip
        return DatabaseUnavailable(f"the database is unavailable ({type(error).__name__}); retry later")
    return ServiceError("internal error: the service failed to answer (it logged why)")


async def _handle_database_error(request: Request, error: Exception) -> JSONResponse:
    """A database (or socket) error in a route: an outage is a 503; anything else is a bug."""
    failure = _failure(request, error)
    if not isinstance(failure, DatabaseUnavailable):
        logger.error("%s %s failed", request.method, request.url.path, exc_info=error)
    return error_response(failure)


async def _handle_unexpected(request: Request, error: Exception) -> JSONResponse:
    """Whatever else escaped, middleware included. The server logs its traceback (Starlette raises
    it on after this answer), so it is not logged here."""
    return error_response(_failure(request, error))


def as_service_error(request: Request, error: Exception) -> ServiceError | None:
    """`error` as the service's error, as the handlers below answer it (for a route that renders
    errors in its protocol's shape); None for what they answer otherwise (Starlette's own HTTP
    errors)."""
    if isinstance(error, ServiceError):
        return error
    if isinstance(error, RequestValidationError):
        return invalid_request(error, request.headers.get("content-type"))
    if isinstance(error, StarletteHTTPException):
        cause = error.__cause__
        return _unparseable(cause) if error.status_code == 400 and cause is not None else None
    failure = _failure(request, error)
    if not isinstance(failure, DatabaseUnavailable):
        logger.error("%s %s failed", request.method, request.url.path, exc_info=error)
    return failure


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ServiceError, _handle_service_error)
    app.add_exception_handler(StarletteHTTPException, _handle_http_exception)
    app.add_exception_handler(RequestValidationError, _handle_validation_error)
    # Inside the routes' error handling, so that an outage is answered without a traceback per request.
    for database_error in DATABASE_ERROR_TYPES:
        app.add_exception_handler(database_error, _handle_database_error)
    app.add_exception_handler(Exception, _handle_unexpected)  # outermost: Starlette's ServerErrorMiddleware
