"""slime's abort loop at the end of a rollout step (abort_servers_until_idle): abort everything on
each worker, then ask its load; while requests remain, wait `retry_interval` and abort again."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

ABORT_RETRY_INTERVAL_SECONDS = 3


def num_requests_from_load(load: Any) -> int:
    """Requests in an SGLang load report: GET /v1/loads answers {"loads": [per DP rank, ...]}."""
    if isinstance(load, list):
        return sum(num_requests_from_load(item) for item in load)
    if not isinstance(load, dict):
        return 0
    if "loads" in load:
        return num_requests_from_load(load["loads"])
    return int(load.get("num_running_reqs", 0)) + int(load.get("num_waiting_reqs", 0))


async def abort_server_until_idle(url: str, retry_interval: float = ABORT_RETRY_INTERVAL_SECONDS) -> int:
    """Returns how many abort rounds it took."""
    rounds = 0
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        while True:
            rounds += 1
            await http.post("/abort_request", json={"abort_all": True})
            load = (await http.get("/v1/loads", params={"include": "core"})).json()
            if num_requests_from_load(load) <= 0:
                return rounds
            await asyncio.sleep(retry_interval)


async def abort_servers_until_idle(
    urls: list[str], retry_interval: float = ABORT_RETRY_INTERVAL_SECONDS
) -> list[int]:
    return list(await asyncio.gather(*(abort_server_until_idle(url, retry_interval) for url in urls)))
