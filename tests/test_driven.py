"""Agent-driven envs' episodes (service/loop/driven.py) without verifiers: handed over to a driver
that calls the model through the episode's own endpoint, finished in the service's process with
the driver's reward and info; a driver's unstorable info and a missing SERVICE_URL fail the episode
saying why; `serve` without SERVICE_URL gives drivers the port it listens on. (verifiers' own
rollouts: tests/test_verifiers_envs.py, in verifiers' virtualenv.)"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.app import create_app
from service.serving import serve_app
from service.sockets import listen, own_url
from service.storage.db import Database
from tests.conftest import service_settings
from tests.support.service_process import service_process, simulated_sglang, wait_batch_finished

DRIVEN = "tests.support.driven_envs:env_specs"


@asynccontextmanager
async def driven_service(database_url: str, *, service_url: bool = True) -> AsyncIterator[httpx.AsyncClient]:
    """The service with the driven test envs (drivers on env threads), its SERVICE_URL its own
    address unless `service_url` is False."""
    async with simulated_sglang(0.01) as (_, sim_url):
        settings = service_settings(database_url, sim_url, env_plugins=DRIVEN)
        async with (
            serve_app(create_app(settings)) as url,
            httpx.AsyncClient(base_url=url, timeout=60) as http,
        ):
            settings.service_url = url if service_url else None
            yield http


async def finished(http: httpx.AsyncClient, env: str, tasks: list[int]) -> list[dict[str, Any]]:
    body = {"env": env, "task_split": "train", "task_indices": tasks, "max_turns": 3}
    response = await http.post("/episodes", json=body)
    assert response.status_code == 202, response.text
    accepted = response.json()
    batch = (await http.get(f"/batches/{accepted['batch_id']}", params={"wait": 60})).json()
    assert batch["complete"], batch["counts"]
    return [(await http.get(f"/episodes/{id_}")).json() for id_ in accepted["episode_ids"]]


async def test_a_driven_episode_is_finished_with_the_drivers_reward_and_info(database_url: str) -> None:
    async with driven_service(database_url) as http:
        episodes = await finished(http, "driven/ask", [0, 1, 2])
    for episode in episodes:
        assert episode["status"] == "completed", episode["error"]
        assert episode["reward"] == 1.0
        assert episode["num_turns"] == 1
        answer = episode["messages"][-1]
        assert answer["role"] == "assistant"
        assert episode["info"]["answer"] == answer["content"]  # the driver's info, as it said


async def test_a_drivers_unstorable_info_aborts_the_episode_saying_why(database_url: str) -> None:
    async with driven_service(database_url) as http:
        [episode] = await finished(http, "driven/not-json", [0])
    assert episode["status"] == "aborted"
    assert episode["reward"] is None
    assert "the driver's info['score'] is nan: only finite numbers are stored" in episode["error"]


async def test_without_a_service_url_the_episode_fails_saying_so(database_url: str) -> None:
    async with driven_service(database_url, service_url=False) as http:
        [episode] = await finished(http, "driven/ask", [0])
    assert episode["status"] == "failed"
    assert "SERVICE_URL is not set" in episode["error"]


async def test_serve_gives_drivers_the_port_it_listens_on(
    database_url: str, db: Database, tmp_path: Path
) -> None:
    """`serve --port P` without SERVICE_URL: drivers call the model at P (it was 8000 whatever P)."""
    async with (
        simulated_sglang(0.01) as (_, sim_url),
        service_process(tmp_path, database_url, sim_url, env_plugins=DRIVEN, env_workers=1) as service,
        httpx.AsyncClient(base_url=service.url, timeout=60) as http,
    ):
        body = {"env": "driven/ask", "task_split": "train", "task_indices": [0, 1], "max_turns": 3}
        accepted = (await http.post("/episodes", json=body)).json()
        episodes = await wait_batch_finished(db, accepted["batch_id"], timeout=60)
    assert [(e.status, e.num_turns, e.error) for e in episodes] == [("completed", 1, None)] * 2


@pytest.mark.parametrize(
    ("host", "url"),
    [("127.0.0.1", "http://127.0.0.1:{}"), ("0.0.0.0", "http://127.0.0.1:{}"), ("::", "http://[::1]:{}")],
)
def test_the_own_url_of_a_listening_socket(host: str, url: str) -> None:
    if ":" in host and not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    with listen(host, 0) as sock:
        assert own_url(sock) == url.format(sock.getsockname()[1])
