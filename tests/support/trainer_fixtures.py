"""The trainer adapters' tests' fixtures, a pytest plugin: a test module with
`pytest_plugins = ("tests.support.trainer_fixtures",)` gets `service` (the service and its simulated
SGLang worker, (url, worker), on each backend) and `tokenizer` (the test tokenizer)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from service.sim.worker import SimWorker
from tests.support.tokenizer import fresh_test_tokenizer
from tests.support.trainer_service import adapter_service


@pytest.fixture
async def service(database_url: str, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[str, SimWorker]]:
    async with adapter_service(database_url, monkeypatch) as running:
        yield running


@pytest.fixture(scope="module")
def tokenizer() -> Iterator[Any]:
    yield fresh_test_tokenizer()
