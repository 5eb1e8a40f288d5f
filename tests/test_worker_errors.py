"""Which failures of the worker's background loops are an outage and which are a bug: storage's one
policy (service/storage/errors.py). A bug is logged with its traceback and neither marks the
database down in /health nor pauses the lease sweep; an outage does both."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
from sqlalchemy.exc import DataError, OperationalError, ProgrammingError

from service.app import create_app
from service.serving import serve_app
from service.storage import queue
from service.storage.errors import is_refused, is_transient
from tests.conftest import service_settings

LEASE_SECONDS = 2.0  # an outage pauses the sweep this long: longer than the test watches it
SWEEP_SECONDS = 0.05
WATCH_SECONDS = 0.8


def _programming_error() -> Exception:
    return ProgrammingError("SELECT nothing FROM nowhere", {}, Exception('relation "nowhere" does not exist'))


def _plain_bug() -> Exception:
    return RuntimeError("a bug in the sweep")


def _outage() -> Exception:
    return OperationalError("SELECT 1", {}, Exception("connection refused"))


def test_the_policy_tells_outages_from_refusals_and_bugs() -> None:
    assert is_transient(_outage()) and not is_refused(_outage())
    assert is_refused(_programming_error()) and not is_transient(_programming_error())
    assert is_refused(DataError("INSERT", {}, Exception("NUL"))) and not is_transient(_plain_bug())
    assert not is_refused(_plain_bug())
    assert is_transient(ConnectionRefusedError()) and is_transient(_wrapped(ConnectionResetError()))


def _wrapped(cause: BaseException) -> Exception:
    try:
        raise cause
    except BaseException as error:
        try:
            raise RuntimeError("while reading") from error
        except RuntimeError as wrapped:
            return wrapped


@pytest.mark.parametrize(
    "make_error", [_programming_error, _plain_bug], ids=["ProgrammingError", "RuntimeError"]
)
async def test_a_bug_in_the_sweep_is_logged_as_a_bug_not_an_outage(
    database_url: str,
    sim: tuple[object, str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    make_error: object,
) -> None:
    sweeps = await _watch_failing_sweep(database_url, sim[1], monkeypatch, caplog, make_error)  # type: ignore[arg-type]
    health, sweep_count = sweeps
    assert health["database"] == "ok", health  # not marked down
    assert sweep_count >= 4, sweep_count  # the sweep went on at its interval, not paused for a lease
    bugs = [
        r for r in caplog.records if r.levelno == logging.ERROR and "sweeping expired leases" in r.message
    ]
    assert bugs and bugs[0].exc_info is not None, [r.message for r in caplog.records]
    assert "a bug" in bugs[0].message
    claims = [r for r in caplog.records if r.levelno == logging.ERROR and "claiming episodes" in r.message]
    assert claims and claims[0].exc_info is not None


async def test_an_outage_in_the_sweep_marks_the_database_down_and_pauses_the_sweep(
    database_url: str,
    sim: tuple[object, str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    health, sweep_count = await _watch_failing_sweep(database_url, sim[1], monkeypatch, caplog, _outage)
    assert health["database"].startswith("error: OperationalError"), health
    assert sweep_count <= 1  # it waits for the database to answer a whole lease
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def _watch_failing_sweep(
    database_url: str,
    sglang_url: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    make_error: type[Exception] | object,
) -> tuple[dict[str, str], int]:
    """Runs the service with every lease sweep and claim raising `make_error()`; returns /health's
    answer and how many sweeps ran in WATCH_SECONDS."""
    calls = 0

    async def failing_sweep(*args: object, **kwargs: object) -> int:
        nonlocal calls
        calls += 1
        raise make_error()  # type: ignore[operator]

    async def failing_claim(*args: object, **kwargs: object) -> list[object]:
        raise make_error()  # type: ignore[operator]

    monkeypatch.setattr(queue, "requeue_expired", failing_sweep)
    monkeypatch.setattr(queue, "any_queued", failing_claim)  # else its next claim says "ok"
    settings = service_settings(
        database_url, sglang_url, lease_seconds=LEASE_SECONDS, sweep_interval_seconds=SWEEP_SECONDS
    )
    caplog.set_level(logging.WARNING, logger="service.worker.worker")
    async with serve_app(create_app(settings)) as url, httpx.AsyncClient(base_url=url, timeout=10) as http:
        await http.get("/ready")  # the database answers: /health says "ok" unless a failure is seen
        await asyncio.sleep(WATCH_SECONDS)
        health = (await http.get("/health")).json()
        return health, calls
