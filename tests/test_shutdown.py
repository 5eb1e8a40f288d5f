"""SIGTERM of a serving process mid-batch: it drains for SHUTDOWN_TIMEOUT_SECONDS, releases what is
left to the queue (attempt + 1, lease cleared) and exits; another process then finishes the rest."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import httpx
import pytest

from service.records import FINISHED_STATUSES
from service.sim.worker import SimWorker
from service.storage.db import Database
from service.storage.models import Episode
from tests.support.contract import assert_trainer_contract, sim_calls
from tests.support.service_process import (
    PLAN_TO_THE_END,
    attempts_seen,
    episodes_of,
    in_second_call,
    service_process,
    simulated_sglang,
    submit,
    wait_batch_finished,
    wait_for,
)

TASKS, SAMPLES = 4, 2
EXIT_MARGIN_SECONDS = 8.0  # uvicorn's shutdown, closing the env worker process, interpreter exit
LONG_POLL_EXIT_MARGIN_SECONDS = 4.0
MID_BATCH_TIMEOUT_SECONDS = 30.0
# uvicorn (>= 0.29) shuts down gracefully on SIGTERM and then re-raises the signal, so a graceful
# exit reads as "killed by SIGTERM"; the log line "Application shutdown complete." tells it apart.
GRACEFUL_EXIT_CODES = {0, -signal.SIGTERM}
FINISH_TIMEOUT_SECONDS = 60.0


def assert_contract(sim_worker: SimWorker, episode: Episode) -> None:
    assert episode.status in {"completed", "truncated", "aborted"}, (episode.id, episode.error)
    tokens = episode.tokens()
    assert tokens is not None
    calls = sim_calls(sim_worker, episode.id, episode.attempt)
    assert len(calls) == episode.num_turns > 0
    assert_trainer_contract(
        tokens.prompt_ids, tokens.response_ids, tokens.loss_mask, tokens.rollout_logprobs, calls
    )


async def test_sigterm_releases_unfinished_episodes_after_the_timeout(
    database_url: str, db: Database, tmp_path: Path
) -> None:
    shutdown_timeout = 1.0
    async with simulated_sglang(latency_seconds=0.6, **PLAN_TO_THE_END) as (sim, sglang_url):
        async with service_process(
            tmp_path, database_url, sglang_url, "first", shutdown_timeout_seconds=shutdown_timeout,
            max_running_episodes=4,
        ) as first:  # fmt: skip
            episode_ids = await submit(first.url, "drain", TASKS, SAMPLES)

            async def mid_batch() -> bool:
                # Some episodes done, and one in its second call: its plan's 3 more (> the timeout) to go.
                episodes = await episodes_of(db, "drain")
                early = in_second_call(sim)
                return any(episode.status in FINISHED_STATUSES for episode in episodes) and any(
                    episode.status == "running" and episode.id in early for episode in episodes
                )

            await wait_for(mid_batch, MID_BATCH_TIMEOUT_SECONDS, "episodes to be mid-way")
            before = {episode.id: episode for episode in await episodes_of(db, "drain")}
            first.terminate()
            started = time.monotonic()
            assert await first.wait_exit(shutdown_timeout + EXIT_MARGIN_SECONDS) in GRACEFUL_EXIT_CODES
            # It drained for the whole timeout (some episodes were still running), and no longer.
            assert shutdown_timeout <= time.monotonic() - started < shutdown_timeout + EXIT_MARGIN_SECONDS
        messages = [line["message"] for line in first.log_lines()]
        assert "Application shutdown complete." in messages and "draining " in "".join(messages), messages

        after = {episode.id: episode for episode in await episodes_of(db, "drain")}
        released = {
            id_ for id_, episode in after.items() if episode.status == "queued" and episode.attempt == 1
        }
        assert released, "every episode finished within the shutdown timeout: make them longer"
        assert f"released {len(released)} unfinished episodes back to the queue" in messages, messages
        for id_, episode in after.items():
            assert episode.status != "running"
            if before[id_].status in FINISHED_STATUSES:
                assert episode.status == before[id_].status and episode.finished_at == before[id_].finished_at
            if before[id_].status == "running":  # finished while draining, or released
                assert episode.status in FINISHED_STATUSES or id_ in released
            if episode.status == "queued":
                assert episode.lease_owner is None and episode.lease_expires_at is None
                assert episode.started_at is None and episode.response_ids is None
                if id_ not in released:  # never claimed: the process stopped claiming at SIGTERM
                    assert episode.attempt == 0 and not attempts_seen(sim, id_)
            else:
                assert episode.status in FINISHED_STATUSES and episode.attempt == 0

        async with service_process(tmp_path, database_url, sglang_url, "second"):
            episodes = await wait_batch_finished(db, "drain", FINISH_TIMEOUT_SECONDS)

    assert [episode.id for episode in episodes] == episode_ids
    for episode in episodes:
        # Released episodes ran again as attempt 1; the cancelled attempt 0 left nothing behind.
        assert episode.attempt == (1 if episode.id in released else 0)
        assert max(attempts_seen(sim, episode.id)) == episode.attempt
        assert_contract(sim, episode)


async def test_sigterm_lets_in_flight_episodes_finish_within_a_generous_timeout(
    database_url: str, db: Database, tmp_path: Path
) -> None:
    async with simulated_sglang(latency_seconds=0.3) as (sim, sglang_url):
        async with service_process(
            tmp_path, database_url, sglang_url, "first", shutdown_timeout_seconds=30, max_running_episodes=4,
        ) as first:  # fmt: skip
            await submit(first.url, "finish", TASKS, SAMPLES)

            async def mid_episode() -> bool:
                episodes = await episodes_of(db, "finish")
                past_first_turn = {r.rid.split(":")[0] for r in sim.requests if not r.rid.endswith(":0")}
                return any(
                    episode.status == "running" and episode.id in past_first_turn for episode in episodes
                )

            await wait_for(mid_episode, MID_BATCH_TIMEOUT_SECONDS, "an episode to be mid-way")
            running_before = {
                episode.id for episode in await episodes_of(db, "finish") if episode.status == "running"
            }
            first.terminate()
            assert await first.wait_exit(FINISH_TIMEOUT_SECONDS) in GRACEFUL_EXIT_CODES
        messages = [line["message"] for line in first.log_lines()]
        assert "Application shutdown complete." in messages, messages
        assert not any(message.startswith("released ") for message in messages), messages

    after = await episodes_of(db, "finish")
    assert not any(episode.status == "running" for episode in after)
    for episode in after:
        assert episode.attempt == 0  # nothing was released
        if episode.id in running_before:
            assert episode.status in FINISHED_STATUSES
        if episode.status == "queued":
            # Never claimed: the draining process stopped claiming at SIGTERM.
            assert episode.attempt == 0 and episode.lease_owner is None and not attempts_seen(sim, episode.id)
        else:
            assert_contract(sim, episode)


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
async def test_sigterm_is_not_held_up_by_a_long_poll(database_url: str, db: Database, tmp_path: Path) -> None:
    """uvicorn waits for open connections before the lifespan shutdown: a trainer's long-poll must
    end at SIGTERM, or it would hold the drain (and the lease release) up to MAX_LONG_POLL_SECONDS."""
    shutdown_timeout = 1.0
    async with simulated_sglang(latency_seconds=3.0) as (sim, sglang_url):
        async with service_process(
            tmp_path, database_url, sglang_url, "first", shutdown_timeout_seconds=shutdown_timeout,
        ) as first:  # fmt: skip
            await submit(first.url, "polled", 2, 1)
            async with httpx.AsyncClient(base_url=first.url, timeout=60) as http:
                poll = asyncio.create_task(http.get("/batches/polled", params={"wait": 60}))
                try:

                    async def generating() -> bool:
                        return len(sim.requests) >= 2

                    await wait_for(generating, MID_BATCH_TIMEOUT_SECONDS, "the first turns")
                    first.terminate()
                    # The poll ends within a second, then the 1 s drain and cleanup.
                    exit_code = await first.wait_exit(shutdown_timeout + LONG_POLL_EXIT_MARGIN_SECONDS)
                finally:
                    poll.cancel()
                    await asyncio.gather(poll, return_exceptions=True)
            assert exit_code in GRACEFUL_EXIT_CODES
    episodes = await episodes_of(db, "polled")
    assert all(episode.status == "queued" and episode.attempt == 1 for episode in episodes)
