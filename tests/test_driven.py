"""Agent-driven envs' episodes (service/loop/driven.py) without verifiers: handed over to a driver
that calls the model through the episode's own endpoint, finished in the service's process with
the driver's reward and info; a driver's unstorable info and a missing SERVICE_URL fail the episode
saying why; `serve` without SERVICE_URL gives drivers the port it listens on. A driven episode
whose worker is lost mid-drive (the service killed, or its lease taken for expired) runs again as
a new attempt, and its dead attempt's token can neither call nor finish it. (verifiers' own
rollouts: tests/test_verifiers_envs.py, in verifiers' virtualenv.)"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select

from service.app import create_app
from service.serving import serve_app
from service.sim.worker import SimWorker
from service.sockets import listen, own_url
from service.storage import queue
from service.storage.db import Database, utcnow
from service.storage.models import Episode, EpisodeSegment
from tests.conftest import service_settings
from tests.support.contract import assert_tokens_match_calls, sim_calls
from tests.support.driven_envs import HOLD_FILE_VARIABLE
from tests.support.service_process import service_process, simulated_sglang, wait_batch_finished, wait_for

DRIVEN = "tests.support.driven_envs:env_specs"
LEASE_SECONDS = 2  # a killed service's driven episode is re-queued about this long after the kill
# Well within EXTERNAL_IDLE_SECONDS (600 s), the deadline at which such an episode failed before.
RERUN_TIMEOUT_SECONDS = 60.0


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


async def stored(db: Database, episode_id: str) -> tuple[Episode, int]:
    """The episode's row and how many closed segments it has."""
    async with db.sessionmaker() as session:
        episode = await session.get_one(Episode, episode_id)
        closed = await session.scalar(
            select(func.count()).select_from(EpisodeSegment).where(EpisodeSegment.episode_id == episode_id)
        )
    return episode, int(closed or 0)


async def holding(db: Database, episode_id: str, attempt: int) -> Episode:
    """The episode once attempt `attempt` of `driven/held` holds: two calls stored, one segment closed."""

    async def two_calls() -> bool:
        episode, closed = await stored(db, episode_id)
        return (episode.status, episode.attempt, episode.num_turns, closed) == ("running", attempt, 2, 1)

    try:
        await wait_for(two_calls, RERUN_TIMEOUT_SECONDS, f"attempt {attempt}'s driver to hold")
    except AssertionError as timeout:
        episode, closed = await stored(db, episode_id)
        found = (episode.status, episode.attempt, episode.num_turns, closed, episode.error)
        raise AssertionError(f"{timeout}; (status, attempt, calls, closed, error): {found}") from None
    return (await stored(db, episode_id))[0]


async def submit_held(http: httpx.AsyncClient) -> tuple[str, str]:
    body = {"env": "driven/held", "task_split": "train", "task_indices": [0], "max_turns": 5}
    response = await http.post("/episodes", json=body)
    assert response.status_code == 202, response.text
    accepted = response.json()
    return accepted["batch_id"], accepted["episode_ids"][0]


async def assert_refused_as_stale(http: httpx.AsyncClient, episode_id: str, token: str | None) -> None:
    """A call and a finish with attempt 0's token: 409, saying the episode was re-queued. With any
    other key shaped as attempt 0's (a guess, or the token with its secret changed): the plain 401,
    which tells nothing of the episode's attempts."""
    assert token is not None and token.startswith("0.")
    changed = token[:-1] + ("A" if token[-1] != "A" else "B")
    for key, status in [(token, 409), ("0.guessed-secret", 401), (changed, 401)]:
        headers = {"Authorization": f"Bearer {key}"}
        call = {"model": "policy", "messages": [{"role": "user", "content": "Still there?"}]}
        refused = [
            await http.post(f"/v1/episodes/{episode_id}/chat/completions", json=call, headers=headers),
            await http.post(f"/v1/episodes/{episode_id}/finish", json={"reward": 0.0}, headers=headers),
        ]
        for response in refused:
            assert response.status_code == status, (key, response.text)
            detail = response.json()["detail"]
            if status == 409:
                assert "was re-queued" in detail and "this token is attempt 0's" in detail, detail
            else:
                assert "attempt" not in detail and "re-queued" not in detail, detail


def assert_attempt_1_only(sim: SimWorker, episode: dict[str, Any]) -> None:
    """Completed by attempt 1's driver: three calls in two segments, each segment's tokens exactly
    its calls' (the trainer contract), and no call of attempt 0 in them."""
    assert (episode["status"], episode["reward"], episode["error"]) == ("completed", 1.0, None)
    assert (episode["attempt"], episode["num_turns"], episode["segments"]) == (1, 3, 2)
    calls = sim_calls(sim, episode["id"], 1)
    assert len(calls) == 3
    assert len(sim_calls(sim, episode["id"], 0)) == 2  # the dead attempt's calls, made and dropped
    (earlier,) = episode["earlier_segments"]
    for segment in (earlier, episode):
        assert_tokens_match_calls(segment, [calls[turn["turn"]] for turn in segment["turns"]])
    assert [len(earlier["turns"]), len(episode["turns"])] == [1, 2]


async def test_a_driven_episode_whose_service_is_killed_mid_drive_runs_again_and_completes(
    database_url: str, db: Database, tmp_path: Path
) -> None:
    """SIGKILL while its driver plays: a restarted service re-runs it as attempt 1 once the killed
    worker's lease expires (not at its idle deadline), and stores attempt 1's calls only."""
    hold = tmp_path / "hold"
    hold.touch()
    settings: dict[str, object] = {"env_plugins": DRIVEN, "lease_seconds": LEASE_SECONDS}
    held_settings = settings | {"driven_hold_file": hold}  # DRIVEN_HOLD_FILE, which its drivers read
    async with simulated_sglang(0.01) as (sim, sim_url):
        async with (
            service_process(tmp_path, database_url, sim_url, "first", **held_settings) as first,
            httpx.AsyncClient(base_url=first.url, timeout=60) as http,
        ):
            batch_id, episode_id = await submit_held(http)
            dead = await holding(db, episode_id, 0)
            first.kill()
            assert await first.wait_exit(10) < 0
        hold.unlink()
        async with (
            service_process(tmp_path, database_url, sim_url, "second", **settings) as second,
            httpx.AsyncClient(base_url=second.url, timeout=60) as http,
        ):
            await wait_batch_finished(db, batch_id, RERUN_TIMEOUT_SECONDS)
            episode = (await http.get(f"/episodes/{episode_id}")).json()
            await assert_refused_as_stale(http, episode_id, dead.agent_token)
            assert (await http.get(f"/episodes/{episode_id}")).json() == episode  # nothing changed
    assert dead.agent_token is not None and dead.agent_token.startswith("0.")
    assert_attempt_1_only(sim, episode)


async def test_a_stale_driver_neither_records_into_nor_finishes_the_new_attempt(
    database_url: str, db: Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's lease taken for expired while its driver holds (a stalled process): the sweep
    re-queues the episode, attempt 1's driver plays it, and attempt 0's driver, still running in
    its thread, has its next call refused; so are a call and a finish with its token."""
    hold = tmp_path / "hold"
    hold.touch()
    monkeypatch.setenv(HOLD_FILE_VARIABLE, str(hold))  # read by the drivers, on this process's env threads
    async with simulated_sglang(0.01) as (sim, sim_url):
        settings = service_settings(database_url, sim_url, env_plugins=DRIVEN)
        async with (
            serve_app(create_app(settings)) as url,
            httpx.AsyncClient(base_url=url, timeout=60) as http,
        ):
            settings.service_url = url
            batch_id, episode_id = await submit_held(http)
            stale = await holding(db, episode_id, 0)
            later = utcnow() + timedelta(seconds=settings.lease_seconds + 60)
            assert await queue.requeue_expired(db.writer, settings.max_failed_attempts, now=later) == 1
            rerun = await holding(db, episode_id, 1)  # attempt 0's driver still holds meanwhile
            assert rerun.agent_token is not None and rerun.agent_token.startswith("1.")
            await assert_refused_as_stale(http, episode_id, stale.agent_token)
            after, closed = await stored(db, episode_id)
            assert (after.status, after.attempt, after.num_turns, after.agent_token, closed) == (
                "running",
                1,
                2,
                rerun.agent_token,
                1,
            )
            hold.unlink()  # both drivers go on: attempt 0's third call is refused, attempt 1's stored
            await wait_batch_finished(db, batch_id, RERUN_TIMEOUT_SECONDS)
            episode = (await http.get(f"/episodes/{episode_id}")).json()
    assert_attempt_1_only(sim, episode)
