"""The OpenAPI document (openapi.yaml) as the service answers: FastAPI's generated one, with the
service's own error body where FastAPI documents its validation error, the bearer scheme of
API_KEYS, and the statuses that the middleware, the body parser and the error handlers give any
operation."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from service.api.errors import (
    BodyUnparseable,
    ErrorBody,
    InvalidRequest,
    PayloadTooLarge,
    ServiceError,
    Unauthorized,
    responses,
)
from service.api.middleware import PUBLIC_PATHS


def link(operation: str, description: str, **parameters: str) -> dict[str, Any]:
    """An OpenAPI link: where an answer's ids are taken next (documentation, and the paths by which
    the stateful tests reach every operation that takes an id). `parameters` maps the operation's
    parameter (`query.batch_id` for a query one) to a runtime expression."""
    return {"operationId": operation, "parameters": parameters, "description": description}


BEARER_SCHEME = "apiKey"
ERROR_SCHEMA_REF = "#/components/schemas/ErrorBody"
FASTAPI_VALIDATION_SCHEMAS = ("HTTPValidationError", "ValidationError")
_REF_TEMPLATE = "#/components/schemas/{model}"


def _response(error: type[ServiceError]) -> dict[str, Any]:
    entry = responses(error)[error.status_code]
    response: dict[str, Any] = {
        "description": entry["description"],
        "content": {"application/json": {"schema": {"$ref": ERROR_SCHEMA_REF}}},
    }
    if "headers" in entry:
        response["headers"] = entry["headers"]
    return response


def _complete_operation(path: str, operation: dict[str, Any]) -> None:
    answers: dict[str, Any] = operation["responses"]
    # FastAPI's HTTPValidationError where it has one: the service answers its ErrorBody instead,
    # and on every operation, which all refuse a query parameter they do not take.
    answers["422"] = _response(InvalidRequest)
    if "requestBody" in operation:
        answers.setdefault("400", _response(BodyUnparseable))
        answers.setdefault("413", _response(PayloadTooLarge))
    if path not in PUBLIC_PATHS:
        operation["security"] = [{BEARER_SCHEME: []}]
        answers.setdefault("401", _response(Unauthorized))
    answers.setdefault("500", _response(ServiceError))
    operation["responses"] = dict(sorted(answers.items()))


def complete_contract(document: dict[str, Any]) -> None:
    """Completes FastAPI's document of the app, in place."""
    for path, operations in document["paths"].items():
        for operation in operations.values():
            _complete_operation(path, operation)
    components = document.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for name in FASTAPI_VALIDATION_SCHEMAS:
        schemas.pop(name, None)
    if "ErrorBody" not in schemas:  # no route lists an error of its own: the body comes from here
        error_schema = ErrorBody.model_json_schema(ref_template=_REF_TEMPLATE)
        schemas.update(error_schema.pop("$defs", {}), ErrorBody=error_schema)
    components["schemas"] = dict(sorted(schemas.items()))
    components["securitySchemes"] = {
        BEARER_SCHEME: {
            "type": "http",
            "scheme": "bearer",
            # No `<key>`: the docs' OAD renderer drops it as an HTML tag ("Bearer `;").
            "description": "One of the service's API_KEYS, as `Authorization: Bearer KEY` (KEY: the key "
            f"itself); every operation but {', '.join(sorted(PUBLIC_PATHS))} needs it when API_KEYS is set.",
        }
    }


def install_contract(app: FastAPI) -> None:
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            complete_contract(generate())  # generate() keeps its document as app.openapi_schema
        assert app.openapi_schema is not None
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend it
