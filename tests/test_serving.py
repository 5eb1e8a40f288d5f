"""The HTTP server as clients meet it: an idle pooled connection is still open when a client's pool
reuses it, so no request fails because the server closed the connection under it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.support.service_process import service_process, simulated_sglang

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
