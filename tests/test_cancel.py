"""POST /batches/{id}/cancel on SQLite and PostgreSQL: queued episodes end `cancelled` at once,
running ones are stopped (in this process, and in another through the engine) and end `cancelled`,
finished ones stay; nothing runs on afterwards; a repeat changes nothing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from rollout_client import AsyncRolloutClient

from service.app import create_app
from service.records import FINISHED_STATUSES
from service.serving import serve_app
from service.sim.policy import SimConfig
from service.sim.worker import SimWorker, create_sim_app, serve_in_thread
from service.storage.db import Database
from tests.conftest import service_settings
from tests.support.service_process import episodes_of, service_process, submission, wait_for

SLOW_TURN_SECONDS = 0.4  # long enough that a cancel finds episodes mid-turn
QUIET_SECONDS = 1.0  # after a cancel, how long no cancelled episode may call the engine
# A worker in another process finds its episodes' batch cancelled within this (its poll: 0.5 s,
# on a loaded machine more).
NOTICE_SECONDS = 30.0
# That worker's lease: long, so that within the test only its cancelled-batch loop can stop the
# episodes. With the suite's 5 s, its heartbeat (every lease / 3) found the cancelled episodes'
# leases gone first at load 20, and stopped them as lost leases.
NOTICE_LEASE_SECONDS = 60.0


@pytest.fixture
def slow_sim() -> Any:
    worker = SimWorker(SimConfig(latency_seconds=SLOW_TURN_SECONDS))
    with serve_in_thread(create_sim_app(worker.config, worker=worker)) as url:
        yield worker, url


@pytest.fixture
async def slow_client(database_url: str, slow_sim: tuple[SimWorker, str]) -> AsyncIterator[httpx.AsyncClient]:
    # Two episodes at a time: the rest of a batch stays queued while those two run.
    app = create_app(service_settings(database_url, slow_sim[1], max_running_episodes=2))
    async with serve_app(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as http:
        yield http


def generate_calls(sim: SimWorker, episode_ids: set[str]) -> int:
    return sum(1 for request in sim.requests if request.rid.split(":")[0] in episode_ids)


async def metric(http: httpx.AsyncClient, name: str, **labels: str) -> float:
    text = (await http.get("/metrics")).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


async def wait_running(db: Database, batch_id: str, count: int) -> None:
    async def running() -> bool:
        statuses = [episode.status for episode in await episodes_of(db, batch_id)]
        return statuses.count("running") >= count

    await wait_for(running, 20, f"{count} running episodes of {batch_id}")


async def cancel_once_running(
    http: httpx.AsyncClient, db: Database, batch_id: str, tasks: int
) -> tuple[set[str], dict[str, Any]]:
    """Submits `tasks` x 2 episodes, cancels them once two run; their ids and the cancel's answer."""
    accepted = await http.post("/episodes", json=submission(batch_id, tasks, 2))
    assert accepted.status_code == 202, accepted.text
    await wait_running(db, batch_id, 2)
    response = await http.post(f"/batches/{batch_id}/cancel")
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return set(accepted.json()["episode_ids"]), answer


async def test_cancel_ends_queued_and_running_episodes_and_keeps_finished_ones(
    slow_client: httpx.AsyncClient, slow_sim: tuple[SimWorker, str], db: Database
) -> None:
    sim = slow_sim[0]
    episode_ids, body = await cancel_once_running(slow_client, db, "c-1", 4)
    assert body["batch_id"] == "c-1"
    assert body["counts"]["queued"] == body["counts"]["running"] == 0
    assert body["cancelled"] == body["counts"]["cancelled"] >= 6  # at most 2 finished meanwhile
    assert sum(body["counts"].values()) == 8

    # The running ones were stopped at the engine: their requests answered abort, and no cancelled
    # episode calls the engine again.
    await wait_for(lambda: _true(sim.running == 0), 5, "the engine to be idle")
    calls = generate_calls(sim, episode_ids)
    await asyncio.sleep(QUIET_SECONDS)
    assert generate_calls(sim, episode_ids) == calls
    episodes = await episodes_of(db, "c-1")
    cancelled = [episode for episode in episodes if episode.status == "cancelled"]
    assert len(cancelled) == body["cancelled"]
    assert all(
        episode.finished_at is not None and "cancelled" in (episode.error or "") for episode in cancelled
    )
    assert all(episode.status in FINISHED_STATUSES for episode in episodes)
    assert await metric(slow_client, "rollout_episodes_cancelled_total", when="running") == 2
    assert (
        await metric(slow_client, "rollout_episodes_cancelled_total", when="queued") == body["cancelled"] - 2
    )
    # A cancel is how they finished: the finished counter by status counts them too.
    assert (
        await metric(slow_client, "rollout_episodes_finished_total", status="cancelled") == body["cancelled"]
    )

    # Final everywhere: the batch is complete, its groups arrive with their cancelled samples.
    batch = (await slow_client.get("/batches/c-1", params={"wait": 5})).json()
    assert batch["complete"] and batch["groups_complete"] == 4
    assert {episode["status"] for episode in batch["episodes"]} <= FINISHED_STATUSES
    one = (await slow_client.get(f"/episodes/{cancelled[0].id}")).json()
    assert one["status"] == "cancelled" and one["trainable"] is False
    await _trainers_tell_cancelled_groups_apart(slow_client, "c-1", body["cancelled"])

    # Idempotent: a repeat cancels nothing and changes nothing.
    again = await slow_client.post("/batches/c-1/cancel")
    assert again.status_code == 200
    assert again.json() == body | {"cancelled": 0}


async def _trainers_tell_cancelled_groups_apart(
    http: httpx.AsyncClient, batch_id: str, cancelled: int
) -> None:
    """GET /groups marks the groups a cancel cut short; each record says whether to train on it; the
    client leaves cancelled groups out unless asked."""
    page = (await http.get("/groups", params={"batch_id": batch_id})).json()
    assert len(page["groups"]) == 4
    cut = set()
    for group in page["groups"]:
        statuses = [episode["status"] for episode in group["episodes"]]
        assert group["cancelled"] == ("cancelled" in statuses)
        assert group["trainable"] == sum(status in ("completed", "truncated") for status in statuses)
        for episode in group["episodes"]:
            assert episode["trainable"] == (episode["status"] in ("completed", "truncated"))
        if group["cancelled"]:
            cut.add(group["group_index"])
    assert cut and sum(len(g["episodes"]) for g in page["groups"] if g["cancelled"]) >= cancelled
    batch = (await http.get(f"/batches/{batch_id}", params={"include_tokens": "true"})).json()
    assert all(episode["trainable"] is (episode["status"] != "cancelled") for episode in batch["episodes"])

    async with AsyncRolloutClient(str(http.base_url)) as client:
        kept = await client.batch(batch_id)
        assert {episode.group_index for episode in kept} == set(range(4)) - cut
        assert all(episode.trainable and episode.status != "cancelled" for episode in kept)
        every = await client.batch(batch_id, include_cancelled=True)
        assert len(every) == 8 and every.table.column("trainable").to_pylist() == every.trainable
        assert [episode.trainable for episode in every] == [e.status != "cancelled" for e in every]
        followed = await client.groups(batch_id=batch_id)
        assert {key[1] for key in followed.groups()} == set(range(4)) - cut
        asked = await client.groups(batch_id=batch_id, include_cancelled=True)
        assert {key[1] for key in asked.groups()} == set(range(4))
        assert "cancelled" in repr(every[[e.status for e in every].index("cancelled")])
        assert len(repr(every[0])) < 300  # no token arrays in it


async def test_cancel_of_a_finished_batch_changes_nothing(client: httpx.AsyncClient, db: Database) -> None:
    assert (await client.post("/episodes", json=submission("done", 2, 1))).status_code == 202
    batch = (await client.get("/batches/done", params={"wait": 30})).json()
    assert batch["complete"]
    response = await client.post("/batches/done/cancel")
    assert response.status_code == 200
    assert response.json() == {"batch_id": "done", "cancelled": 0, "counts": batch["counts"]}
    assert (await client.get("/batches/done")).json()["counts"] == batch["counts"]


async def test_cancel_of_an_unknown_batch_is_404(client: httpx.AsyncClient) -> None:
    response = await client.post("/batches/nope/cancel")
    assert response.status_code == 404
    assert "nope" in response.text


async def test_cancel_through_an_api_process_stops_another_process_episodes(
    database_url: str, db: Database, tmp_path: Path, slow_sim: tuple[SimWorker, str]
) -> None:
    """The API process holds none of the running episodes: it aborts them at the engine, and the
    worker process stores none of their results."""
    sim, sglang_url = slow_sim
    async with (
        service_process(tmp_path, database_url, sglang_url, "api", run_worker="false") as api,
        service_process(
            tmp_path,
            database_url,
            sglang_url,
            "worker",
            max_running_episodes=2,
            lease_seconds=NOTICE_LEASE_SECONDS,
        ) as worker,
        httpx.AsyncClient(base_url=api.url, timeout=30) as http,
    ):
        episode_ids, answer = await cancel_once_running(http, db, "c-x", 3)
        assert answer["counts"]["running"] == 0

        def stopped() -> Awaitable[bool]:
            said = (line.get("message", "") for line in worker.log_lines())
            return _true(any("episodes of cancelled batches ['c-x']" in message for message in said))

        await wait_for(stopped, NOTICE_SECONDS, "the worker to stop the cancelled batch's episodes")
        await wait_for(lambda: _true(sim.running == 0), 5, "the engine to be idle")
        calls = generate_calls(sim, episode_ids)
        await asyncio.sleep(QUIET_SECONDS)
        assert generate_calls(sim, episode_ids) == calls
        statuses = [episode.status for episode in await episodes_of(db, "c-x")]
        assert statuses.count("cancelled") == answer["cancelled"] >= 4
        assert worker.process.poll() is None


async def _true(value: bool) -> bool:
    return value
