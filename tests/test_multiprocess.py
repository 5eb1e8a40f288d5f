"""Two service processes on one database share a batch: claims are disjoint, every episode runs and is
stored exactly once, and both processes do part of the work."""

from __future__ import annotations

from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from service.storage.db import Database
from tests.support.contract import assert_trainer_contract, sim_calls
from tests.support.service_process import (
    attempts_seen,
    service_process,
    simulated_sglang,
    submission,
    wait_batch_finished,
)

# SERVICE_ENV's, but env work on threads (2, the default count) rather than a worker process each.
SETTINGS: dict[str, object] = {
    "env_executor": "thread",
    "env_workers": 2,
    # Few episodes each, so that one process cannot claim the whole batch the moment it is submitted.
    "max_running_episodes": 4,
}
TASKS, SAMPLES = 12, 2
FINISH_TIMEOUT_SECONDS = 60.0


async def episodes_finished_here(http: httpx.AsyncClient) -> int:
    response = await http.get("/metrics")
    assert response.status_code == 200
    return int(
        sum(
            sample.value
            for family in text_string_to_metric_families(response.text)
            for sample in family.samples
            if sample.name == "rollout_episodes_finished_total"
        )
    )


async def test_two_processes_share_a_batch_each_episode_once(
    database_url: str, db: Database, tmp_path: Path
) -> None:
    async with (
        simulated_sglang(latency_seconds=0.05) as (sim, sglang_url),
        service_process(tmp_path, database_url, sglang_url, "a", **SETTINGS) as first,
        service_process(tmp_path, database_url, sglang_url, "b", **SETTINGS) as second,
        httpx.AsyncClient(base_url=first.url, timeout=10) as http_first,
        httpx.AsyncClient(base_url=second.url, timeout=10) as http_second,
    ):
        response = await http_first.post("/episodes", json=submission("shared", TASKS, SAMPLES))
        assert response.status_code == 202, response.text
        episode_ids = response.json()["episode_ids"]
        episodes = await wait_batch_finished(db, "shared", FINISH_TIMEOUT_SECONDS)
        finished_first = await episodes_finished_here(http_first)
        finished_second = await episodes_finished_here(http_second)

    assert [episode.id for episode in episodes] == episode_ids
    assert finished_first + finished_second == len(episode_ids) == TASKS * SAMPLES
    assert finished_first > 0 and finished_second > 0, (finished_first, finished_second)
    for episode in episodes:
        assert episode.status in {"completed", "truncated", "aborted"}, (episode.id, episode.error)
        # Run once: the only attempt that reached the engine is the stored one, never re-queued.
        assert episode.attempt == 0 and attempts_seen(sim, episode.id) == {0}
        tokens = episode.tokens()
        assert tokens is not None
        calls = sim_calls(sim, episode.id, 0)
        assert len(calls) == episode.num_turns > 0
        # A turn sent twice (two processes running one episode) would show as a duplicate rid.
        rids = [r.rid for r in sim.requests if r.rid.startswith(f"{episode.id}:")]
        assert len(rids) == len(set(rids)) == episode.num_turns
        assert_trainer_contract(
            tokens.prompt_ids, tokens.response_ids, tokens.loss_mask, tokens.rollout_logprobs, calls
        )
