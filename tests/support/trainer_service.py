"""The service the trainer adapters' tests run against: the app served on a free port over the
test's database, the simulated SGLang worker in its own thread, and the adapter's environment
variables set; and the stored episode, read back to compare with what the trainer received.
Its fixtures are in tests/support/trainer_fixtures.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest

from service.app import create_app
from service.serving import serve_app
from service.sim.policy import SimConfig
from service.sim.worker import SimWorker, create_sim_app, serve_in_thread
from tests.conftest import service_settings

# Mistakes often enough that a small step has aborted episodes (malformed tool calls) among others:
# none in a step of 20 episodes has odds 0.6**20, 4e-5.
ADAPTER_SIM = SimConfig(latency_seconds=0.01, malformed_call_rate=0.4, ramble_rate=0.1)


@asynccontextmanager
async def adapter_service(
    database_url: str, monkeypatch: pytest.MonkeyPatch, sim: SimConfig = ADAPTER_SIM, **settings: object
) -> AsyncIterator[tuple[str, SimWorker]]:
    worker = SimWorker(sim)
    with serve_in_thread(create_sim_app(worker.config, worker=worker)) as sglang_url:
        async with serve_app(create_app(service_settings(database_url, sglang_url, **settings))) as url:
            monkeypatch.setenv("ROLLOUT_SERVICE_URL", url)
            monkeypatch.setenv("ROLLOUT_ENV", "builtin/shop")
            monkeypatch.setenv("ROLLOUT_TASK_SPLIT", "test")
            monkeypatch.setenv("ROLLOUT_EVAL_TASK_SPLIT", "test")
            monkeypatch.setenv("ROLLOUT_MAX_TURNS", "10")
            monkeypatch.delenv("ROLLOUT_RUN_ID", raising=False)
            monkeypatch.delenv("ROLLOUT_API_KEY", raising=False)
            yield url, worker


async def stored_episodes(url: str, episode_ids: list[str]) -> dict[str, dict[str, Any]]:
    """The episodes as GET /episodes/{id} answers them (the test's check, not the adapter's path)."""
    episodes: dict[str, dict[str, Any]] = {}
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        for episode_id in dict.fromkeys(episode_ids):
            response = await http.get(f"/episodes/{episode_id}")
            assert response.status_code == 200, response.text
            episodes[episode_id] = response.json()
    return episodes


def batch_ids_of(episodes: dict[str, dict[str, Any]]) -> set[str]:
    return {episode["batch_id"] for episode in episodes.values()}
