"""openapi.yaml at the top of the repository is the API's contract: it must match the app."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from service.openapi import openapi_yaml

SPEC = Path(__file__).resolve().parents[1] / "openapi.yaml"
ERROR_BODY = "#/components/schemas/ErrorBody"


def test_openapi_yaml_is_generated_from_the_app() -> None:
    assert SPEC.read_text() == openapi_yaml(), "openapi.yaml drifted: run `make openapi` and review the diff"


def test_operation_ids_are_stable_and_errors_documented() -> None:
    spec = yaml.safe_load(SPEC.read_text())
    operations = {op["operationId"]: op for path in spec["paths"].values() for op in path.values()}
    assert set(operations) >= {
        "submit_episodes",
        "get_episode",
        "get_batch",
        "list_envs",
        "health",
        "ready",
        "metrics",
    }
    assert {"409", "413", "422"} <= set(operations["submit_episodes"]["responses"])
    assert "application/vnd.apache.arrow.stream" in operations["get_batch"]["responses"]["200"]["content"]


def _operations(spec: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(path, method, op) for path, item in spec["paths"].items() for method, op in item.items()]


def test_every_error_answer_is_documented_as_the_service_sends_it() -> None:
    spec = yaml.safe_load(SPEC.read_text())
    schemas = spec["components"]["schemas"]
    assert "HTTPValidationError" not in schemas and "HTTPValidationError" not in SPEC.read_text()
    assert schemas["ErrorBody"]["required"] == ["detail"]
    assert schemas["ErrorBody"]["properties"]["errors"]["items"]["$ref"].endswith("/FieldError")
    assert set(schemas["FieldError"]["required"]) == {"loc", "msg", "type"}
    for path, method, operation in _operations(spec):
        answers = operation["responses"]
        assert "500" in answers, (path, method)
        for status, answer in answers.items():
            if int(status) >= 400:
                content = answer["content"]["application/json"]["schema"]
                assert content == {"$ref": ERROR_BODY}, (path, method, status)
        if "requestBody" in operation:
            assert {"400", "413", "422"} <= set(answers), (path, method)
        if "503" in answers:
            assert "Retry-After" in answers["503"]["headers"], (path, method)
    operations = {op["operationId"]: op for _, _, op in _operations(spec)}
    for name in ("submit_episodes", "get_episode", "get_batch", "metrics", "ready"):
        assert "503" in operations[name]["responses"], name  # they read or write the database
    assert {"404", "422"} <= set(operations["get_batch"]["responses"])
    links = operations["submit_episodes"]["responses"]["202"]["links"]
    assert {"get_batch", "get_episode", "cancel_batch"} <= {link["operationId"] for link in links.values()}


def test_the_bearer_scheme_covers_every_operation_but_the_probes_and_the_scrape() -> None:
    spec = yaml.safe_load(SPEC.read_text())
    scheme = spec["components"]["securitySchemes"]["apiKey"]
    assert (scheme["type"], scheme["scheme"]) == ("http", "bearer")
    for path, method, operation in _operations(spec):
        if path in {"/health", "/ready", "/metrics"}:
            assert "security" not in operation and "401" not in operation["responses"], method
        else:
            assert operation["security"] == [{"apiKey": []}], (path, method)
            assert "WWW-Authenticate" in operation["responses"]["401"]["headers"], (path, method)
    assert {method for method in spec["paths"]["/health"]} == {"get", "head"}
