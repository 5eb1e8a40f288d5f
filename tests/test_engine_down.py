"""An engine that is down, on SQLite and PostgreSQL: the service warns at start-up, `GET /batches/{id}`
and the viewer's batch read say the episodes wait for it, and the outage costs them no attempt
(MAX_ATTEMPTS=1 here: one counted failure would end an episode `failed`)."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import uvicorn

from service.app import create_app
from service.serving import serve_app
from service.sim.policy import SimConfig
from service.sim.worker import SimWorker, create_sim_app
from tests.conftest import service_settings
from tests.support.service_process import submission, wait_for

START_TIMEOUT_SECONDS = 10.0
TURN_SECONDS = 0.2
OUTAGE_SECONDS = 2.0


def _port_socket(port: int = 0) -> socket.socket:
    """A socket bound to the port that does not listen yet: connections to it are refused."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    return sock


@contextmanager
def engine_on(sock: socket.socket, worker: SimWorker) -> Iterator[None]:
    """The simulated engine answering on `sock` until the block ends (then its port refuses)."""
    sock.listen()
    server = uvicorn.Server(
        uvicorn.Config(
            create_sim_app(worker.config, worker=worker), log_level="error", lifespan="off", ws="none"
        )
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the simulated engine did not start"
        time.sleep(0.01)
    try:
        yield
    finally:
        server.should_exit = True
        thread.join(timeout=START_TIMEOUT_SECONDS)
        sock.close()


async def _batch(http: httpx.AsyncClient, batch_id: str) -> dict[str, Any]:
    response = await http.get(f"/batches/{batch_id}")
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


async def test_a_down_engine_is_waited_for_not_charged(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    worker = SimWorker(SimConfig(latency_seconds=TURN_SECONDS))
    down = _port_socket()
    port = down.getsockname()[1]
    engine_url = f"http://127.0.0.1:{port}"
    settings = service_settings(
        database_url, engine_url, max_attempts=1, engine_retries=2, engine_backoff_seconds=0.05
    )
    with caplog.at_level(logging.WARNING, logger="service.engine.status"):
        async with (
            serve_app(create_app(settings)) as url,
            httpx.AsyncClient(base_url=url, timeout=30) as http,
        ):
            # Start-up: the engine does not answer, and the log says so at once.
            assert any("does not answer" in record.getMessage() for record in caplog.records)
            assert (await http.post("/episodes", json=submission("down-1", 2, 2))).status_code == 202

            async def waiting() -> bool:
                note = (await _batch(http, "down-1"))["waiting_for_engine"]
                return note is not None and engine_url in note and "waiting for the engine" in note

            await wait_for(waiting, 10, "GET /batches to say the episodes wait for the engine")
            viewer = (await http.get("/batches/down-1/episodes")).json()
            assert "waiting for the engine" in viewer["waiting_for_engine"]
            assert (await _batch(http, "down-1"))["counts"]["queued"] == 4  # nothing claimed meanwhile

            # The engine comes up: the batch runs; then it goes down mid-batch and comes back.
            with engine_on(down, worker):
                await wait_for(
                    lambda: _true(len(worker.requests) >= 2), 20, "the episodes to reach the engine"
                )
            outage = _port_socket(port)
            await wait_for(waiting, 20, "GET /batches to see the engine go down mid-batch")
            await asyncio.sleep(OUTAGE_SECONDS)  # a few rounds of retries and probes
            counts = (await _batch(http, "down-1"))["counts"]
            assert counts["failed"] == 0 and counts["completed"] < 4
            with engine_on(outage, worker):
                batch = (await http.get("/batches/down-1", params={"wait": 60})).json()
    assert batch["complete"], batch["counts"]
    # Every episode played to its end (the policy's outcome, whatever it is), none failed.
    assert batch["counts"]["failed"] == 0 and len(batch["episodes"]) == 4
    assert all(episode["status"] in ("completed", "truncated", "aborted") for episode in batch["episodes"])
    assert batch["waiting_for_engine"] is None
    # At least one episode was cut off by the outage and ran again: a re-run, not a failure.
    assert any(episode["attempt"] >= 1 for episode in batch["episodes"])


async def _true(value: bool) -> bool:
    return value
