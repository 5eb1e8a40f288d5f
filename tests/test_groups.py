"""GET /groups: complete groups of every batch in the order they completed, by a cursor kept in the
database; per-group reward statistics; the min_reward_std filter. On SQLite and PostgreSQL, through
one service and through two service processes writing to one database."""

from __future__ import annotations

import asyncio
import math
import statistics
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select, update

from service.records import EpisodeRequest
from service.storage import groups
from service.storage.batches import NewBatch, NewEpisode, submit_batch
from service.storage.db import Database
from service.storage.groups import GroupFilter, RewardStats
from service.storage.models import Episode, Group
from tests.support.service_process import (
    episodes_of,
    service_process,
    simulated_sglang,
    submission,
    wait_for,
)
from tests.support.settings import CONNECT_TIMEOUT_SECONDS

ARROW = {"Accept": "application/vnd.apache.arrow.stream"}


# ---- reward statistics ----


@given(st.lists(st.one_of(st.none(), st.floats(-10, 10)), max_size=16))
def test_reward_stats_match_the_statistics_module(rewards: list[float | None]) -> None:
    stats = RewardStats.of(rewards)
    values = [reward for reward in rewards if reward is not None]
    assert stats.count == len(values)
    if not values:
        assert (stats.mean, stats.std, stats.min, stats.max) == (None, None, None, None)
        return
    assert stats.mean == pytest.approx(statistics.fmean(values), abs=1e-9)
    assert stats.std == pytest.approx(statistics.pstdev(values), abs=1e-6)
    assert (stats.min, stats.max) == (min(values), max(values))
    if len(set(values)) == 1:
        assert stats.std == 0.0  # exactly: a filter tests std > 0


# ---- the log, at the database ----


def new_batch(batch_id: str, tasks: int, samples: int, env: str = "builtin/shop") -> NewBatch:
    return NewBatch(
        batch_id=batch_id,
        request_hash=batch_id,
        env=env,
        task_split="train",
        metadata={},
        episodes=[
            NewEpisode(group, sample, EpisodeRequest(env, "train", 10 + group, {}, 5))
            for group in range(tasks)
            for sample in range(samples)
        ],
    )


async def finish(db: Database, batch_id: str, group: int, rewards: list[float | None]) -> None:
    """Ends the group's episodes (by sample) with these rewards, as results would."""
    async with db.sessionmaker.begin() as session:
        for sample, reward in enumerate(rewards):
            await session.execute(
                update(Episode)
                .where(
                    Episode.batch_id == batch_id, Episode.group_index == group, Episode.sample_index == sample
                )
                .values(status="completed" if reward is not None else "failed", reward=reward)
            )


async def log(db: Database, candidates: list[tuple[str, int]] | None = None) -> list[groups.CompletedGroup]:
    async with db.sessionmaker.begin() as session:
        return await groups.log_complete(session, candidates)


async def page(db: Database, after: int, limit: int = 100, **where: Any) -> groups.GroupPage:
    async with db.reader() as session:
        return await groups.read_page(session, after, limit, GroupFilter(**where))


async def test_a_group_is_logged_once_when_its_last_episode_ends(db: Database) -> None:
    await submit_batch(db, new_batch("b", tasks=3, samples=2))
    await finish(db, "b", 1, [1.0])  # one of two
    assert await log(db) == []
    await finish(db, "b", 1, [1.0, 0.0])
    await finish(db, "b", 0, [0.5, 0.5])
    logged = await log(db, [("b", 0), ("b", 1), ("b", 2)])
    assert sorted(group.key for group in logged) == [("b", 0), ("b", 1)]
    assert [group.seq for group in logged] == [1, 2]
    assert await log(db) == []  # never twice
    stats = {group.key: group.stats for group in logged}
    assert stats[("b", 1)] == RewardStats(2, 0.5, 0.5, 0.0, 1.0)
    assert stats[("b", 0)] == RewardStats(2, 0.5, 0.0, 0.5, 0.5)
    await finish(db, "b", 2, [None, None])  # failed episodes: complete, without rewards
    (last,) = await log(db)
    assert (last.key, last.seq, last.stats.count, last.stats.std) == (("b", 2), 3, 0, None)


async def test_pages_follow_the_cursor_and_filter(db: Database) -> None:
    await submit_batch(db, new_batch("one", tasks=4, samples=2))
    await submit_batch(db, new_batch("two", tasks=2, samples=2, env="test/probe"))
    rewards = {("one", 0): [1.0, 1.0], ("one", 1): [1.0, 0.0], ("two", 0): [0.0, 0.0], ("one", 2): [0.0, 1.0]}
    for (batch, group), values in rewards.items():
        await finish(db, batch, group, values)
        await log(db)  # one at a time: seq is the order they completed
    first = await page(db, 0, limit=2)
    assert [(g.batch_id, g.group_index, g.seq) for g in first.groups] == [("one", 0, 1), ("one", 1, 2)]
    assert (first.next, first.filtered) == (2, 0)
    rest = await page(db, first.next)
    assert [(g.batch_id, g.group_index) for g in rest.groups] == [("two", 0), ("one", 2)]
    assert (await page(db, rest.next)).groups == []
    assert (await page(db, rest.next)).next == rest.next  # nothing new: the cursor stays

    useful = await page(db, 0, min_reward_std=0.0)
    assert [(g.batch_id, g.group_index) for g in useful.groups] == [("one", 1), ("one", 2)]
    assert (useful.next, useful.filtered) == (4, 2)
    # A page that stops at `limit` stops its cursor there too: the filtered group after it is not counted.
    assert (await page(db, 0, limit=1, min_reward_std=0.0)).next == 2
    assert [g.env for g in (await page(db, 0, env="test/probe")).groups] == ["test/probe"]
    assert [g.group_index for g in (await page(db, 0, batch_ids=("one",))).groups] == [0, 1, 2]
    assert [(g.batch_id, g.group_index) for g in (await page(db, 0, batch_ids=("two", "one"))).groups] == [
        ("one", 0), ("one", 1), ("two", 0), ("one", 2),
    ]  # fmt: skip


async def test_concurrent_loggers_hand_out_every_seq_once(database_url: str, db: Database) -> None:
    """Four connections log at once while groups complete: each group once, seqs 1..N without a gap,
    and no reader ever sees a seq before a smaller one commits."""
    tasks = 60
    await submit_batch(db, new_batch("race", tasks=tasks, samples=1))
    others = [Database.open(database_url, connect_timeout=CONNECT_TIMEOUT_SECONDS) for _ in range(3)]
    seen: list[int] = []
    done = asyncio.Event()

    async def reader() -> None:
        cursor = 0
        while not done.is_set() or cursor < tasks:
            got = await page(db, cursor)
            seqs = [group.seq for group in got.groups]
            assert seqs == list(range(cursor + 1, cursor + 1 + len(seqs))), (cursor, seqs)
            seen.extend(seqs)  # type: ignore[arg-type]
            cursor = got.next
            await asyncio.sleep(0.001)

    async def logger(database: Database) -> None:
        for _ in range(40):
            async with database.sessionmaker.begin() as session:
                await groups.log_complete(session, None)
            await asyncio.sleep(0.002)

    async def finisher() -> None:
        for group in range(tasks):
            await finish(db, "race", group, [float(group % 2)])
            await asyncio.sleep(0.001)

    try:
        reading = asyncio.create_task(reader())
        await asyncio.gather(finisher(), *(logger(database) for database in [db, *others]))
        await log(db)
        done.set()
        await asyncio.wait_for(reading, 30)
    finally:
        for database in others:
            await database.dispose()
    assert seen == list(range(1, tasks + 1))
    async with db.reader() as session:
        stored = list(await session.scalars(select(Group).order_by(Group.group_index)))
    assert sorted(group.seq for group in stored) == list(range(1, tasks + 1))  # type: ignore[type-var]


# ---- through the service ----


async def all_groups(http: httpx.AsyncClient, limit: int, **params: Any) -> tuple[list[dict[str, Any]], int]:
    """Follows the cursor until a page is empty: the groups and what was filtered."""
    cursor, found, filtered = 0, [], 0
    while True:
        response = await http.get("/groups", params={"after": cursor, "limit": limit, **params})
        assert response.status_code == 200, response.text
        body = response.json()
        assert response.headers["rollout-next-cursor"] == str(body["next"])
        found.extend(body["groups"])
        filtered += body["filtered"]
        if not body["groups"]:
            return found, filtered
        assert body["next"] > cursor
        cursor = body["next"]


async def wait_complete(http: httpx.AsyncClient, batch_id: str) -> dict[str, Any]:
    response = await http.get(f"/batches/{batch_id}", params={"wait": 60})
    assert response.status_code == 200 and response.json()["complete"], response.text
    body: dict[str, Any] = response.json()
    return body


async def test_the_stream_delivers_every_complete_group_once_with_its_statistics(
    client: httpx.AsyncClient, db: Database
) -> None:
    for batch_id in ("s1", "s2"):
        response = await client.post("/episodes", json=submission(batch_id, 6, 3))
        assert response.status_code == 202, response.text
    batches = [await wait_complete(client, batch_id) for batch_id in ("s1", "s2")]

    async def logged() -> bool:
        return len((await all_groups(client, 100))[0]) == 12

    await wait_for(logged, 10, "12 logged groups")
    found, filtered = await all_groups(client, limit=5)
    assert filtered == 0
    assert sorted((g["batch_id"], g["group_index"]) for g in found) == [
        (b, i) for b in ("s1", "s2") for i in range(6)
    ]
    assert [g["cursor"] for g in found] == sorted(g["cursor"] for g in found)
    for group in found:
        episodes = group["episodes"]
        assert [e["sample_index"] for e in episodes] == [0, 1, 2]
        assert all(e["group_index"] == group["group_index"] and e["status"] != "running" for e in episodes)
        rewards = [e["reward"] for e in episodes if e["reward"] is not None]
        assert group["reward"]["count"] == len(rewards)
        if rewards:
            assert group["reward"]["mean"] == pytest.approx(statistics.fmean(rewards))
            assert group["reward"]["std"] == pytest.approx(statistics.pstdev(rewards), abs=1e-9)
            assert (group["reward"]["min"], group["reward"]["max"]) == (min(rewards), max(rewards))

    # The batch response carries the same statistics, and counts the groups the filter drops.
    uniform = 0
    for batch in batches:
        stats = {g["group_index"]: g["reward"] for g in batch["groups"]}
        assert sorted(stats) == list(range(6))
        for group in found:
            if group["batch_id"] == batch["batch_id"]:
                assert stats[group["group_index"]]["std"] == pytest.approx(group["reward"]["std"], abs=1e-9)
                assert stats[group["group_index"]]["mean"] == pytest.approx(group["reward"]["mean"])
        uniform += batch["groups_filtered"]
    kept, skipped = await all_groups(client, limit=5, min_reward_std=0)
    assert skipped == uniform == sum(1 for g in found if not g["reward"]["std"])
    assert {(g["batch_id"], g["group_index"]) for g in kept} == {
        (g["batch_id"], g["group_index"]) for g in found if g["reward"]["std"]
    }
    assert 0 < len(kept) < len(found)  # the sim's seeded mistakes give both kinds

    only, _ = await all_groups(client, limit=100, batch_id="s2")
    assert {g["batch_id"] for g in only} == {"s2"} and len(only) == 6
    both, _ = await all_groups(client, limit=100, batch_id=["s2", "s1", "nowhere"])
    assert [(g["batch_id"], g["group_index"]) for g in both] == [
        (g["batch_id"], g["group_index"]) for g in found
    ]  # in the order they completed, whichever batch

    # Arrow: the page's episodes, group by group, the cursor in a header.
    response = await client.get("/groups", params={"after": 0, "limit": 4}, headers=ARROW)
    assert response.status_code == 200
    table = pa.ipc.open_stream(response.content).read_all()
    keys = [(g["batch_id"], g["group_index"]) for g in found[:4]]
    rows = zip(table.column("batch_id").to_pylist(), table.column("group_index").to_pylist(), strict=True)
    assert list(rows) == [key for key in keys for _ in range(3)]
    assert int(response.headers["rollout-next-cursor"]) == found[3]["cursor"]
    stored = {e.id: e for batch_id in ("s1", "s2") for e in await episodes_of(db, batch_id)}
    for episode_id, response_ids in zip(
        table.column("episode_id").to_pylist(), table.column("response_ids").to_pylist(), strict=True
    ):
        tokens = stored[episode_id].tokens()
        assert tokens is not None and response_ids == tokens.response_ids

    metrics = (await client.get("/metrics")).text
    values = {
        sample.name: sample.value
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
    }
    assert values["rollout_groups_completed_total"] == 12
    assert values["rollout_groups_filtered_total"] >= skipped


async def test_a_long_poll_returns_when_a_group_completes(client: httpx.AsyncClient) -> None:
    start = (await client.get("/groups")).json()["next"]
    waiting = asyncio.create_task(client.get("/groups", params={"after": start, "wait": 30}))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    response = await client.post("/episodes", json=submission("late", 1, 2))
    assert response.status_code == 202
    answer = await asyncio.wait_for(waiting, 30)
    body = answer.json()
    assert [(g["batch_id"], g["group_index"]) for g in body["groups"]] == [("late", 0)]
    # Nothing after it: a short wait answers empty, the cursor where it was.
    empty = await client.get("/groups", params={"after": body["next"], "wait": 0.2})
    assert empty.json() == {"groups": [], "next": body["next"], "filtered": 0}


async def test_cancelled_groups_enter_the_stream(client: httpx.AsyncClient) -> None:
    body = submission("gone", 3, 2, sampling_params={"max_new_tokens": 16})
    response = await client.post("/episodes", json=body)
    assert response.status_code == 202
    assert (await client.post("/batches/gone/cancel")).status_code == 200
    answer = await client.get("/groups", params={"batch_id": "gone", "wait": 10})
    found = answer.json()["groups"]

    async def all_three() -> bool:
        found[:] = (await all_groups(client, 100, batch_id="gone"))[0]
        return len(found) == 3

    await wait_for(all_three, 10, "the cancelled batch's groups")
    assert sorted(g["group_index"] for g in found) == [0, 1, 2]


async def test_bad_parameters_are_named(client: httpx.AsyncClient) -> None:
    for params, field, *index in [
        ({"after": -1}, "after"),
        ({"limit": 0}, "limit"),
        ({"limit": 1001}, "limit"),
        ({"min_reward_std": -0.5}, "min_reward_std"),
        ({"batch_id": "no spaces"}, "batch_id", 0),
        ({"batch_id": ["ok", "no spaces"]}, "batch_id", 1),  # which of them
        ({"batch_id": [f"b{i}" for i in range(257)]}, "batch_id"),
        ({"cursor": 3}, "cursor"),
    ]:
        response = await client.get("/groups", params=params)
        assert response.status_code == 422, (params, response.text)
        assert response.json()["errors"][0]["loc"] == ["query", field, *index]


# ---- two service processes writing, one reader following the cursor through both ----

TWO_PROCESS_SETTINGS: dict[str, object] = {
    "env_executor": "thread",
    "env_workers": 2,
    "max_running_episodes": 6,
}


@pytest.fixture
async def two_services(database_url: str, tmp_path: Path) -> AsyncIterator[tuple[str, str]]:
    async with (
        simulated_sglang(latency_seconds=0.02) as (_, sglang_url),
        service_process(tmp_path, database_url, sglang_url, "a", **TWO_PROCESS_SETTINGS) as first,
        service_process(tmp_path, database_url, sglang_url, "b", **TWO_PROCESS_SETTINGS) as second,
    ):
        yield first.url, second.url


async def test_one_cursor_across_two_processes_never_repeats_nor_skips(
    two_services: tuple[str, str], db: Database
) -> None:
    urls = two_services
    batches, tasks, samples = ["x1", "x2", "x3"], 8, 2
    async with httpx.AsyncClient(timeout=60) as http:
        for index, batch_id in enumerate(batches):
            response = await http.post(
                f"{urls[index % 2]}/episodes", json=submission(batch_id, tasks, samples)
            )
            assert response.status_code == 202, response.text
        # Read while they run: a small page from each process in turn, long-polling.
        cursor, delivered, turn = 0, [], 0
        expected = len(batches) * tasks
        deadline = asyncio.get_running_loop().time() + 90
        while len(delivered) < expected:
            assert asyncio.get_running_loop().time() < deadline, f"{len(delivered)} of {expected} groups"
            response = await http.get(
                f"{urls[turn % 2]}/groups", params={"after": cursor, "limit": 3, "wait": 2}
            )
            turn += 1
            assert response.status_code == 200, response.text
            body = response.json()
            assert body["next"] >= cursor
            for group in body["groups"]:
                assert group["cursor"] > cursor
                cursor = group["cursor"]
                delivered.append((group["batch_id"], group["group_index"]))
                assert all(e["status"] not in ("queued", "running") for e in group["episodes"])
            cursor = body["next"]
    assert len(delivered) == len(set(delivered)) == expected
    assert set(delivered) == {(b, g) for b in batches for g in range(tasks)}
    # Both processes finished episodes; the log agrees with the episodes.
    async with db.reader() as session:
        stored = list(await session.scalars(select(Group)))
    assert sorted(group.seq for group in stored) == list(range(1, expected + 1))  # type: ignore[type-var]
    for group in stored:
        rewards = [
            e.reward for e in await episodes_of(db, group.batch_id) if e.group_index == group.group_index
        ]
        assert group.reward_count == sum(1 for r in rewards if r is not None)
        values = [r for r in rewards if r is not None]
        if values:
            assert math.isclose(group.reward_mean or 0.0, statistics.fmean(values), abs_tol=1e-9)
