"""SIGKILL of a serving process mid-batch: a new process finishes every episode exactly once, and no
token of the killed attempts reaches the stored episodes."""

from __future__ import annotations

from pathlib import Path

import httpx

from service.records import FINISHED_STATUSES
from service.storage.db import Database
from tests.support.contract import assert_trainer_contract, sim_calls
from tests.support.service_process import (
    attempts_seen,
    episodes_of,
    service_process,
    simulated_sglang,
    submission,
    wait_batch_finished,
    wait_for,
)

LEASE_SECONDS = 2  # the killed process's episodes are re-queued within about this long
TASKS, SAMPLES = 4, 2
MID_BATCH_TIMEOUT_SECONDS = 30.0
RECOVERY_TIMEOUT_SECONDS = 60.0


async def test_killed_process_episodes_rerun_once_under_a_new_attempt(
    database_url: str, db: Database, tmp_path: Path
) -> None:
    async with simulated_sglang(latency_seconds=0.3) as (sim, sglang_url):
        async with service_process(
            tmp_path, database_url, sglang_url, "first", lease_seconds=LEASE_SECONDS
        ) as first:
            async with httpx.AsyncClient(base_url=first.url, timeout=10) as http:
                # A batch that finishes before the kill, then one that the kill interrupts.
                done = await http.post("/episodes", json=submission("done", 1, SAMPLES))
                assert done.status_code == 202, done.text
                await wait_batch_finished(db, "done", MID_BATCH_TIMEOUT_SECONDS)
                response = await http.post("/episodes", json=submission("crash", TASKS, SAMPLES))
                assert response.status_code == 202, response.text
            episode_ids = done.json()["episode_ids"] + response.json()["episode_ids"]

            async def mid_batch() -> bool:
                episodes = await episodes_of(db, "crash")
                past_first_turn = {r.rid.split(":")[0] for r in sim.requests if not r.rid.endswith(":0")}
                return any(
                    episode.status == "running" and episode.id in past_first_turn for episode in episodes
                )

            await wait_for(mid_batch, MID_BATCH_TIMEOUT_SECONDS, "episodes to be mid-way")
            first.kill()
            assert await first.wait_exit(10) < 0
        at_kill = {
            episode.id: episode for batch in ("done", "crash") for episode in await episodes_of(db, batch)
        }
        interrupted = {id_ for id_, episode in at_kill.items() if episode.status == "running"}
        finished_before = {id_ for id_, episode in at_kill.items() if episode.status in FINISHED_STATUSES}
        assert interrupted and finished_before, {id_: episode.status for id_, episode in at_kill.items()}
        assert interrupted | finished_before == set(episode_ids)  # every episode was claimed at once

        async with service_process(tmp_path, database_url, sglang_url, "second", lease_seconds=LEASE_SECONDS):
            episodes = await wait_batch_finished(db, "done", RECOVERY_TIMEOUT_SECONDS)
            episodes += await wait_batch_finished(db, "crash", RECOVERY_TIMEOUT_SECONDS)

        assert [episode.id for episode in episodes] == episode_ids
        for episode in episodes:
            assert episode.status in {"completed", "truncated", "aborted"}, (episode.id, episode.error)
            assert episode.lease_expires_at is None and episode.finished_at is not None
            if episode.id in interrupted:
                assert episode.attempt >= 1
                # The killed attempt did run (it generated turns or was about to); only the last
                # attempt's result is stored.
                assert max(attempts_seen(sim, episode.id)) == episode.attempt
            else:
                assert episode.attempt == 0 and attempts_seen(sim, episode.id) == {0}
                # Stored before the kill, and not rewritten since.
                assert episode.finished_at == at_kill[episode.id].finished_at
            tokens = episode.tokens()
            assert tokens is not None
            calls = sim_calls(sim, episode.id, episode.attempt)
            assert len(calls) == episode.num_turns > 0
            assert_trainer_contract(
                tokens.prompt_ids, tokens.response_ids, tokens.loss_mask, tokens.rollout_logprobs, calls
            )
