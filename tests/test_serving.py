"""The HTTP server as clients meet it: an idle pooled connection is still open when a client's pool
reuses it, so no request fails because the server closed the connection under it. And `serve`'s
allocation snapshots for diagnosing memory growth (TRACEMALLOC_DIR): nothing is traced until the
first SIGUSR2, and each SIGUSR2 after it writes a snapshot of the process's Python heap."""

from __future__ import annotations

import asyncio
import os
import signal
import tracemalloc
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from service.storage.db import Database
from tests.support.service_process import (
    ServiceProcess,
    service_process,
    simulated_sglang,
    submit,
    wait_batch_finished,
    wait_for,
)

# Longer than uvicorn's own keep-alive (5 s), shorter than aiohttp's pool keeps a connection (15 s).
IDLE_SECONDS = 6.0


async def get_health(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    """One request on an open connection; the status line, or b"" if the server had closed it."""
    writer.write(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
    await writer.drain()
    status = await reader.readline()
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    await reader.readexactly(int(headers.get("content-length", 0)))
    return status


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
async def test_an_idle_connection_outlives_the_pools_of_common_clients(
    database_url: str, tmp_path: Path
) -> None:
    async with (
        simulated_sglang(0.01) as (_, sglang_url),
        service_process(tmp_path, database_url, sglang_url) as service,
    ):
        address = urlsplit(service.url)
        reader, writer = await asyncio.open_connection(address.hostname, address.port)
        try:
            assert (await get_health(reader, writer)).startswith(b"HTTP/1.1 200")
            await asyncio.sleep(IDLE_SECONDS)
            assert (await get_health(reader, writer)).startswith(b"HTTP/1.1 200"), "the server closed it"
        finally:
            writer.close()


SIGNAL_TIMEOUT_SECONDS = 60.0
BATCH_TIMEOUT_SECONDS = 120.0


def tracemalloc_lines(service: ServiceProcess) -> list[dict[str, object]]:
    return [line for line in service.log_lines() if str(line.get("message", "")).startswith("tracemalloc")]


async def signalled(service: ServiceProcess, lines: int) -> list[dict[str, object]]:
    """Sends SIGUSR2 and waits for the service's log line about it (the snapshot is written before)."""
    os.kill(service.pid, signal.SIGUSR2)

    async def logged() -> bool:
        return len(tracemalloc_lines(service)) >= lines

    await wait_for(logged, SIGNAL_TIMEOUT_SECONDS, f"tracemalloc log line {lines}")
    return tracemalloc_lines(service)


async def test_sigusr2_starts_tracing_and_then_writes_snapshots_that_name_the_service_code(
    database_url: str, db: Database, tmp_path: Path
) -> None:
    snapshots = tmp_path / "snapshots"
    async with simulated_sglang(latency_seconds=0.01) as (_, sglang_url):
        async with service_process(tmp_path, database_url, sglang_url, tracemalloc_dir=snapshots) as service:
            started = await signalled(service, 1)
            assert "tracemalloc started" in str(started[0]["message"])
            assert not list(snapshots.glob("*.pickle"))  # the first signal only starts tracing

            await signalled(service, 2)
            await submit(service.url, "traced", 2, 2)
            await wait_batch_finished(db, "traced", BATCH_TIMEOUT_SECONDS)
            lines = await signalled(service, 3)
            assert service.process.poll() is None  # the signal ended nothing

    first, second = sorted(snapshots.glob("*.pickle"))
    assert (first.name, second.name) == (
        f"tracemalloc-{service.pid}-001.pickle",
        f"tracemalloc-{service.pid}-002.pickle",
    )
    for line, path in zip(lines[1:], (first, second), strict=True):
        assert str(path) in str(line["message"]) and "bytes traced" in str(line["message"])
        assert "episode_id" not in line  # not logged as a line of whatever episode the signal interrupted
    grown = tracemalloc.Snapshot.load(str(second)).compare_to(
        tracemalloc.Snapshot.load(str(first)), "filename"
    )
    service_files = {
        stat.traceback[0].filename
        for stat in grown
        if stat.size_diff > 0 and "/service/" in stat.traceback[0].filename
    }
    assert service_files, "the batch's allocations are traced to the service's modules"
