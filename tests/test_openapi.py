"""openapi.yaml at the top of the repository is the API's contract: it must match the app."""

from __future__ import annotations

from pathlib import Path

import yaml

from service.openapi import openapi_yaml

SPEC = Path(__file__).resolve().parents[1] / "openapi.yaml"


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
