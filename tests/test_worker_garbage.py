"""An episode's run leaves no reference cycles behind in the worker: garbage in cycles waits for a
full collection, which TUNE_GC's thresholds make rare, and grew the soak's RSS (docs/benchmarks.md)."""

from __future__ import annotations

import asyncio
import gc
from collections import Counter
from collections.abc import Iterator

import httptools
import httpx
import pytest

from service.app import create_app
from service.engine.transport import SocketTransport, _Connection
from service.serving import serve_app
from service.sim.worker import SimConfig, create_sim_app, serve_in_thread
from tests.conftest import service_settings

TASKS, SAMPLES = 4, 4
# Per-episode objects of the worker's store path that cyclic garbage used to hold (tenacity's
# retrying object, built for each write, and the claim its callback closed over).
WORKER_TYPES = {"AsyncRetrying", "IterState", "ClaimedEpisode", "EpisodeSpec", "EpisodeRequest"}
# SQLAlchemy statements built for each block of stored results (the complete-groups query's EXISTS
# and its subquery) are cyclic garbage: their builders keep them as module constants.
STATEMENT_TYPES = {"Select", "Exists", "ScalarSelect"}


@pytest.fixture
def garbage_saved() -> Iterator[list[object]]:
    """Automatic collection off, and what a collection finds unreachable kept in gc.garbage."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield gc.garbage
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


async def test_finished_episodes_leave_no_cycles_of_the_worker(
    database_url: str, garbage_saved: list[object]
) -> None:
    with serve_in_thread(create_sim_app(SimConfig(latency_seconds=0.01))) as sglang_url:
        async with serve_app(create_app(service_settings(database_url, sglang_url))) as url:
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                body = {"batch_id": "cycles", "env": "builtin/shop", "task_split": "test",
                        "task_indices": list(range(TASKS)), "samples_per_task": SAMPLES}  # fmt: skip
                assert (await http.post("/episodes", json=body)).status_code == 202
                while not (await http.get("/batches/cycles", params={"wait": 30})).json()["complete"]:
                    pass
                gc.collect()
    found = Counter(type(item).__name__ for item in garbage_saved)
    assert not {name: found[name] for name in WORKER_TYPES if found[name]}
    statements = sum(found[name] for name in STATEMENT_TYPES)
    assert statements / (TASKS * SAMPLES) < 0.1, {name: found[name] for name in STATEMENT_TYPES}


async def test_closed_engine_connections_leave_no_cycles(garbage_saved: list[object]) -> None:
    """A connection the server closes (here each one, asked with `connection: close`) is freed by
    its reference count: it and its httptools parser no longer point at each other once it is lost."""
    requests = 20
    transport = SocketTransport()
    with serve_in_thread(create_sim_app(SimConfig(latency_seconds=0.0))) as sglang_url:
        try:
            for _ in range(requests):
                reply = await transport.post(f"{sglang_url}/no-such-path", b"{}", 10, {"connection": "close"})
                assert reply.status == 404
            await asyncio.sleep(0.1)  # the loop calls connection_lost of the last one
        finally:
            await transport.aclose()
        gc.collect()
    ours = [item for item in garbage_saved if isinstance(item, _Connection | httptools.HttpResponseParser)]
    assert len(ours) / requests == 0, Counter(type(item).__name__ for item in ours)
