"""Weight updates lose no work, on SQLite and PostgreSQL: while a batch runs, a trainer aborts every
request on the engine until it is idle, as slime does at the end of each rollout step, and loads new
weights. The turns the aborts cut resume from what they sampled: no episode ends aborted or failed
because of it, no token is sampled twice, and each token records the weights that sampled it."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.app import create_app
from service.records import version_number
from service.serving import serve_app
from service.sim.policy import SimConfig
from service.sim.worker import SimWorker, create_sim_app, serve_in_thread
from service.storage import engine_state
from service.storage.db import Database
from tests.conftest import service_settings
from tests.support.contract import assert_stored_episode_matches_sim, sim_calls
from tests.support.polling import until
from tests.support.service_process import episodes_of, submission

sys.path.insert(0, str(Path(__file__).parent / "slime_standin"))

from slime.backends.sglang_utils.server_control import abort_servers_until_idle

UPDATES = 3
# Requests long enough to be cut mid-turn, and no mistakes of the policy's own: any abort is ours.
SIM = SimConfig(latency_seconds=0.05, per_token_latency_seconds=0.004, malformed_call_rate=0.0)


# Turns of a second or more: however slow the service is between turns (a loaded machine), several
# are in flight at the engine when a pause reaches it.
LONG_TURNS_SIM = replace(SIM, per_token_latency_seconds=0.02)


@asynccontextmanager
async def serving(
    database_url: str, config: SimConfig
) -> AsyncIterator[tuple[SimWorker, str, httpx.AsyncClient]]:
    sim = SimWorker(config)
    with serve_in_thread(create_sim_app(sim.config, worker=sim)) as sim_url:
        app = create_app(service_settings(database_url, sim_url, engine_abort_quiet_seconds=0.5))
        async with serve_app(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
            yield sim, sim_url, http


@pytest.fixture
async def running(database_url: str) -> AsyncIterator[tuple[SimWorker, str, httpx.AsyncClient]]:
    async with serving(database_url, SIM) as service:
        yield service


async def test_slime_abort_until_idle_and_weight_updates_lose_no_work(
    running: tuple[SimWorker, str, httpx.AsyncClient],
) -> None:
    sim, sim_url, http = running
    accepted = await http.post("/episodes", json=submission("w", 6, 2, max_turns=20))
    assert accepted.status_code == 202, accepted.text
    rounds = []
    for version in range(1, UPDATES + 1):
        await asyncio.sleep(0.6)
        rounds += await asyncio.wait_for(abort_servers_until_idle([sim_url], retry_interval=0.5), 20)
        sim.update_weights(str(version), abort_all=False)
    assert all(count <= 3 for count in rounds), rounds  # the service went quiet: slime saw it idle

    batch = (await http.get("/batches/w", params={"wait": 120})).json()
    assert batch["complete"], batch["counts"]
    assert batch["counts"]["aborted"] == batch["counts"]["failed"] == 0, batch["counts"]
    resumed = 0
    for summary in batch["episodes"]:
        episode: dict[str, Any] = (await http.get(f"/episodes/{summary['id']}")).json()
        assert_stored_episode_matches_sim(sim, episode)
        calls = sim_calls(sim, episode["id"], episode["attempt"])
        # Nothing sampled twice: the engine's outputs are the stored sampled tokens, once each.
        assert sum(len(call.output_ids) for call in calls) == sum(episode["loss_mask"])
        resumed += sum(1 for turn in episode["turns"] if turn["resume"] > 0)
        # Each sampled token carries the version of the call that sampled it.
        expected = [turn["weight_version"] for turn in episode["turns"] for _ in range(turn["output_tokens"])]
        sampled = [
            v for v, m in zip(episode["token_weight_versions"], episode["loss_mask"], strict=True) if m
        ]
        assert sampled == expected
        assert all(
            v is None
            for v, m in zip(episode["token_weight_versions"], episode["loss_mask"], strict=True)
            if not m
        )
    assert resumed > 0  # the updates did cut turns
    versions = {
        turn["weight_version"]
        for summary in batch["episodes"]
        for turn in (await http.get(f"/episodes/{summary['id']}")).json()["turns"]
    }
    assert len(versions) > 1
    metrics = (await http.get("/metrics")).text
    assert "rollout_turn_resumes_total" in metrics


async def test_a_pause_with_mode_abort_resumes_its_turns_after_continue(database_url: str) -> None:
    async with serving(database_url, LONG_TURNS_SIM) as (sim, _, http):
        accepted = await http.post("/episodes", json=submission("p", 4, 2, max_turns=20))
        assert accepted.status_code == 202, accepted.text
        # Waits on the engine, not the clock: under load the first turns came 1.5 s after the submit.
        await until(lambda: sim.running >= 4, timeout_seconds=60)  # in flight: the pause cuts them
        assert (await http.post("/engine/pause", json={"mode": "abort"})).status_code == 200
        await until(lambda: sim.running > 0, timeout_seconds=60)  # resumed turns, held by the pause
        assert sim.waiting == sim.running
        assert (await http.post("/engine/continue")).status_code == 200
        batch = (await http.get("/batches/p", params={"wait": 120})).json()
        counts = batch["counts"]
        assert batch["complete"] and counts["aborted"] == counts["failed"] == 0, counts
        turns = [
            turn
            for summary in batch["episodes"]
            for turn in (await http.get(f"/episodes/{summary['id']}")).json()["turns"]
        ]
    assert any(turn["resume"] > 0 for turn in turns)
    cut = [turn for turn in turns if turn["finish_reason"].get("message") == "Aborted by pause_generation."]
    assert cut, turns


async def test_max_staleness_reruns_episodes_whose_tokens_fall_too_far_behind(
    running: tuple[SimWorker, str, httpx.AsyncClient], db: Database
) -> None:
    """With max_staleness 0 every stored episode was sampled by one weight version: those an update
    overtook ran again from scratch, as new attempts that are not failures."""
    sim, _, http = running
    accepted = await http.post("/episodes", json=submission("s", 4, 2, max_turns=20, max_staleness=0))
    assert accepted.status_code == 202, accepted.text
    for version in (1, 2):
        await asyncio.sleep(0.4)
        sim.update_weights(str(version), abort_all=False)
    batch = (await http.get("/batches/s", params={"wait": 120})).json()
    assert batch["complete"] and batch["counts"]["completed"] + batch["counts"]["truncated"] == 8, batch
    stored = await episodes_of(db, "s")
    assert any(episode.attempt > 0 for episode in stored)  # some were overtaken and re-ran
    assert all(episode.failures == 0 for episode in stored)
    for episode in stored:
        versions = {turn["weight_version"] for turn in episode.turns or []}
        assert len(versions) == 1, versions


async def test_max_staleness_is_measured_against_the_newest_version_of_any_process(
    running: tuple[SimWorker, str, httpx.AsyncClient], db: Database
) -> None:
    """Another process of the service sampled from weight version 3 (shared in the database); this
    one's engine is still at its first (`default`, 0). With max_staleness 1 its episodes are 3 behind
    the service's newest: every attempt is stale, and the episode ends failed saying so. One turn,
    over long before the versions loop's first round (1 s): this process, idle until then, reads
    the newest version as it claims the episode (CI saw a 20-turn episode complete, unbounded)."""
    _, _, http = running
    await engine_state.raise_newest_version(db.writer, 3)
    accepted = await http.post("/episodes", json=submission("x", 1, 1, max_turns=1, max_staleness=1))
    assert accepted.status_code == 202, accepted.text
    batch = (await http.get("/batches/x", params={"wait": 120})).json()
    assert batch["complete"] and batch["counts"]["failed"] == 1, batch["counts"]
    (episode,) = await episodes_of(db, "x")
    assert episode.error is not None and "newest (3)" in episode.error, episode.error


def test_weight_versions_as_numbers() -> None:
    assert [version_number(v) for v in ("default", "0", "7", "step-7", None, "1.5")] == [
        0,
        0,
        7,
        None,
        None,
        None,
    ]
