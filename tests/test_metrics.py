"""GET /metrics after a batch: valid Prometheus text whose counters agree with the stored episodes."""

from __future__ import annotations

import gc
from collections import Counter
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select

from service.records import FINISHED_STATUSES
from service.storage.db import Database
from service.storage.models import Episode

TASKS, SAMPLES = 3, 2
ALL_STATUSES = FINISHED_STATUSES | {"queued", "running"}


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the exposition, by (name, sorted labels); parsing fails on invalid text."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def by_label(
    values: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, label: str
) -> dict[str, float]:
    return {dict(labels)[label]: value for (sample, labels), value in values.items() if sample == name}


async def scrape(client: httpx.AsyncClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return samples(response.text)


async def test_metrics_agree_with_the_stored_batch(client: httpx.AsyncClient, db: Database) -> None:
    before = await scrape(client)
    assert sum(by_label(before, "rollout_episodes_finished_total", "status").values()) == 0
    assert before[("rollout_turns_total", ())] == 0

    body: dict[str, Any] = {
        "batch_id": "metrics",
        "env": "builtin/shop",
        "task_split": "test",
        "task_indices": list(range(TASKS)),
        "samples_per_task": SAMPLES,
        "sampling_params": {"max_new_tokens": 200},
        "max_turns": 10,
    }
    assert (await client.post("/episodes", json=body)).status_code == 202
    # Gauges are read from the database at scrape time: mid-batch they count what is queued or
    # running, and once the batch is done those drop back to 0 rather than keep their last value.
    during = await scrape(client)
    assert sum(by_label(during, "rollout_episodes", "status").values()) == TASKS * SAMPLES
    assert during[("rollout_queue_depth", ())] == by_label(during, "rollout_episodes", "status")["queued"]
    batch = (await client.get("/batches/metrics", params={"wait": 60})).json()
    assert batch["complete"], batch["counts"]
    after = await scrape(client)

    async with db.sessionmaker() as session:
        episodes = list(await session.scalars(select(Episode)))
    assert len(episodes) == TASKS * SAMPLES
    statuses = Counter(episode.status for episode in episodes)
    tokens = [episode.tokens() for episode in episodes]
    turns = [turn for episode in episodes for turn in episode.turns or []]

    assert after[("rollout_episodes_submitted_total", ())] == TASKS * SAMPLES
    finished = by_label(after, "rollout_episodes_finished_total", "status")
    assert set(finished) == FINISHED_STATUSES
    assert sum(finished.values()) == TASKS * SAMPLES
    assert {status: count for status, count in finished.items() if count} == statuses

    assert (
        after[("rollout_turns_total", ())]
        == sum(episode.num_turns or 0 for episode in episodes)
        == len(turns)
    )
    assert len(turns) > 0
    kinds = by_label(after, "rollout_tokens_total", "kind")
    assert kinds["prompt"] == sum(len(t.prompt_ids) for t in tokens if t is not None)
    assert kinds["sampled"] == sum(sum(t.loss_mask) for t in tokens if t is not None)
    assert kinds["context"] == sum(len(t.loss_mask) - sum(t.loss_mask) for t in tokens if t is not None)
    assert kinds["sampled"] > 0 and kinds["context"] > 0

    assert after[("rollout_engine_seconds_count", ())] == len(turns)
    assert 0 < after[("rollout_engine_seconds_sum", ())]
    assert after[("rollout_engine_seconds_bucket", (("le", "+Inf"),))] == len(turns)
    steps = [turn for turn in turns if turn["action"] is not None]
    assert after[("rollout_env_seconds_count", ())] == len(steps)

    gauge = by_label(after, "rollout_episodes", "status")
    assert set(gauge) == ALL_STATUSES
    assert {status: count for status, count in gauge.items() if count} == statuses
    assert after[("rollout_queue_depth", ())] == 0
    assert after[("rollout_inflight_episodes", ())] == 0
    assert after[("rollout_inflight_generates", ())] == 0


async def test_metrics_time_garbage_collections(client: httpx.AsyncClient) -> None:
    """rollout_gc_pause_seconds counts the process's collections, a full one among them."""
    before = by_label(await scrape(client), "rollout_gc_pause_seconds_count", "generation")
    assert set(before) == {"0", "1", "2"}
    gc.collect()
    after = await scrape(client)
    assert by_label(after, "rollout_gc_pause_seconds_count", "generation")["2"] >= before["2"] + 1
    assert by_label(after, "rollout_gc_pause_seconds_sum", "generation")["2"] > 0
