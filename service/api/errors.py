"""The service's errors: each carries its HTTP status; one handler renders them all alike."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException


class ErrorBody(BaseModel):
    """Every 4xx/5xx answer: `detail` says what is wrong; `errors` lists field problems."""

    detail: str
    errors: list[dict[str, Any]] = []


class ServiceError(Exception):
    status_code = 500
    description = "Internal error"

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
    description = "Invalid request"

    @classmethod
    def field(cls, location: list[str | int], message: str) -> InvalidRequest:
        path = ".".join(str(part) for part in location)
        return cls(f"{path}: {message}", [{"loc": ["body", *location], "msg": message}])


class PayloadTooLarge(ServiceError):
    status_code = 413
    description = "Request body too large"


class Unauthorized(ServiceError):
    status_code = 401
    description = "Missing or wrong API key"


class NotReady(ServiceError):
    status_code = 503
    description = "A dependency is unreachable"


def responses(*errors: type[ServiceError]) -> dict[int | str, dict[str, Any]]:
    """The `responses=` entry of a route that may raise these errors."""
    return {error.status_code: {"model": ErrorBody, "description": error.description} for error in errors}


def error_response(error: ServiceError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if isinstance(error, Unauthorized) else None
    body = ErrorBody(detail=error.detail, errors=error.errors)
    return JSONResponse(body.model_dump(), status_code=error.status_code, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    async def handle_service_error(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, ServiceError)
        return error_response(error)

    async def handle_validation_error(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, RequestValidationError)
        problems = [
            {"loc": list(item["loc"]), "msg": item["msg"], "type": item["type"]} for item in error.errors()
        ]
        summary = "; ".join(
            f"{'.'.join(str(part) for part in item['loc'] if part != 'body') or 'body'}: {item['msg']}"
            for item in problems
        )
        return error_response(InvalidRequest(summary, problems))

    async def handle_http_exception(request: Request, error: Exception) -> JSONResponse:
        assert isinstance(error, StarletteHTTPException)
        body = ErrorBody(detail=str(error.detail))
        return JSONResponse(body.model_dump(), status_code=error.status_code, headers=error.headers)

    app.add_exception_handler(ServiceError, handle_service_error)
    app.add_exception_handler(StarletteHTTPException, handle_http_exception)
    app.add_exception_handler(RequestValidationError, handle_validation_error)
