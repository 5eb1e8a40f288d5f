"""The trainer's bulk pull, GET /batches/{id} as an Arrow stream: chunked reads of one snapshot
(service/storage/batch_rows.py) streamed as record batches (api/streaming.arrow_stream), on both backends."""

from __future__ import annotations

import asyncio
import io
import json
import random
import uuid
from collections.abc import AsyncIterator, Iterable
from typing import Any

import httpx
import pyarrow as pa
import pytest
from starlette.types import Message

from service.api.arrow import ARROW_SCHEMA, ARROW_STREAM_MEDIA_TYPE
from service.api.batch_json import batch_summary_json
from service.api.episode_detail import episode_detail
from service.api.schemas import EpisodeSummary, EpisodeWithTokens
from service.api.streaming import BatchStreamResponse, arrow_stream, tokens_json_stream
from service.app import create_app
from service.records import EpisodeRequest, EpisodeResult, EpisodeStatus, EpisodeTokens, TurnRecord
from service.serving import serve_app
from service.shared import GroupSummaries
from service.storage.batch_rows import CHUNK_BYTES, open_batch_rows
from service.storage.batches import NewBatch, NewEpisode, enqueue_batch
from service.storage.db import Database
from service.storage.queue import claim_episodes, finish_episode
from tests.conftest import service_settings
from tests.support.openai_stub import closed_port_url
from tests.support.reads import load_batch_episodes

ARROW = {"Accept": ARROW_STREAM_MEDIA_TYPE}
TOKEN_ARRAYS = ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs")
PLAYED = [EpisodeStatus.COMPLETED, EpisodeStatus.TRUNCATED, EpisodeStatus.ABORTED]


@pytest.fixture
async def api(database_url: str) -> AsyncIterator[httpx.AsyncClient]:
    """The API alone (no worker claims what the tests store) on a free port."""
    app = create_app(service_settings(database_url, closed_port_url(), run_worker=False))
    async with serve_app(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
        yield http


async def store_batch(db: Database, groups: int, samples: int, claim: int) -> tuple[str, list[Any]]:
    """A batch of groups x samples episodes, the first `claim` of them (in group order) running;
    returns its id and the claims."""
    batch_id = f"pull-{uuid.uuid4().hex[:8]}"
    async with db.sessionmaker.begin() as session:
        await enqueue_batch(
            session,
            NewBatch(
                batch_id=batch_id,
                request_hash="h" * 64,
                env="builtin/shop",
                task_split="test",
                metadata={},
                episodes=[
                    NewEpisode(group, sample, EpisodeRequest("builtin/shop", "test", 40 + group, {}, 8))
                    for group in range(groups)
                    for sample in range(samples)
                ],
            ),
        )
    claims = await claim_episodes(db.sessionmaker, "tests", claim, 600)
    assert len(claims) == claim
    return batch_id, claims


def result(rng: random.Random, tokens: int, status: EpisodeStatus = EpisodeStatus.COMPLETED) -> EpisodeResult:
    if status == EpisodeStatus.FAILED:
        return EpisodeResult.failed("engine unreachable")
    start, scale = rng.randrange(150_000), rng.random()
    mask = [(start + i // 37) % 2 for i in range(tokens)]  # runs of sampled and template tokens
    return EpisodeResult(
        status=status,
        reward=rng.random(),
        tokens=EpisodeTokens(
            prompt_ids=[(start + 31 * i) % 150_000 for i in range(rng.randint(1, 300))],
            response_ids=[(start + 7919 * i) % 150_000 for i in range(tokens)],
            loss_mask=mask,
            rollout_logprobs=[-scale * (i % 101) / 7 if bit else 0.0 for i, bit in enumerate(mask)],
        ),
        messages=[{"role": "user", "content": f"tâche n°{start} ✓"}],
        info={"task": {"id": start}, "nested": [scale, None, "x"]},
        turns=[
            TurnRecord(turn, f"w{turn}", {"type": rng.choice(["stop", "length"])}, 1, 0.1)
            for turn in range(3)
        ],
    )


def read_stream(body: bytes) -> tuple[pa.Table, int]:
    """The stream's rows and how many record batches carried them."""
    reader = pa.ipc.open_stream(io.BytesIO(body))
    batches = list(reader)
    assert reader.schema.equals(ARROW_SCHEMA, check_metadata=True)
    return pa.Table.from_batches(batches, schema=ARROW_SCHEMA), len(batches)


async def test_a_batch_of_many_chunks_streams_whole_and_exact(api: httpx.AsyncClient, db: Database) -> None:
    rng = random.Random(10)
    tokens = 40_000  # 13 bytes a token: 40 episodes take 3 chunks
    batch_id, claims = await store_batch(db, groups=20, samples=2, claim=40)
    for claim in claims:
        status = EpisodeStatus.FAILED if claim.group_index == 3 and claim.sample_index else None
        outcome = result(rng, tokens, status or rng.choice(PLAYED))
        assert await finish_episode(db.sessionmaker, "tests", claim.id, claim.attempt, outcome)
    assert 40 * tokens * 13 > 2 * CHUNK_BYTES

    response = await api.get(f"/batches/{batch_id}", headers=ARROW)
    assert response.status_code == 200
    assert response.headers["content-type"] == ARROW_STREAM_MEDIA_TYPE
    table, record_batches = read_stream(response.content)
    assert record_batches >= 3
    rows = table.to_pylist()
    assert [(row["group_index"], row["sample_index"]) for row in rows] == [
        (group, sample) for group in range(20) for sample in range(2)
    ]
    for row in rows:
        episode = (await api.get(f"/episodes/{row['episode_id']}")).json()
        for key in (*TOKEN_ARRAYS, "weight_versions"):
            assert row[key] == (episode[key] or []), key
        assert row["finish_reasons"] == [reason["type"] for reason in episode["finish_reasons"]]
        for key in ("batch_id", "status", "reward", "task_index", "attempt", "num_turns", "error"):
            assert row[key] == episode[key], key
        assert json.loads(row["messages_json"]) == episode["messages"]
        assert json.loads(row["info_json"]) == episode["info"]
    failed = rows[7]
    assert failed["status"] == "failed" and failed["error"] and failed["response_ids"] == []


async def test_only_complete_groups_are_sent(api: httpx.AsyncClient, db: Database) -> None:
    rng = random.Random(11)
    batch_id, claims = await store_batch(db, groups=4, samples=2, claim=6)  # group 3 stays queued
    finished = {  # group 0 completed, group 1 one failed (finished all the same), group 2 half done
        (0, 0): EpisodeStatus.COMPLETED,
        (0, 1): EpisodeStatus.TRUNCATED,
        (1, 0): EpisodeStatus.FAILED,
        (1, 1): EpisodeStatus.ABORTED,
        (2, 0): EpisodeStatus.COMPLETED,
    }
    for claim in claims:
        status = finished.get((claim.group_index, claim.sample_index))
        if status is not None:
            outcome = result(rng, 50, status)
            assert await finish_episode(db.sessionmaker, "tests", claim.id, claim.attempt, outcome)

    table, _ = read_stream((await api.get(f"/batches/{batch_id}", headers=ARROW)).content)
    assert [(row["group_index"], row["sample_index"]) for row in table.to_pylist()] == list(finished)[:4]
    summary = (await api.get(f"/batches/{batch_id}")).json()
    assert [episode["id"] for episode in summary["episodes"]] == table["episode_id"].to_pylist()


async def test_no_complete_group_is_an_empty_stream_and_an_unknown_batch_a_404(
    api: httpx.AsyncClient, db: Database
) -> None:
    batch_id, _ = await store_batch(db, groups=2, samples=2, claim=1)
    response = await api.get(f"/batches/{batch_id}", headers=ARROW)
    assert response.status_code == 200
    table, _ = read_stream(response.content)
    assert table.num_rows == 0

    missing = await api.get("/batches/nope", headers=ARROW)
    assert missing.status_code == 404
    assert "nope" in missing.json()["detail"]


async def finished_batch(db: Database, episodes: int) -> str:
    rng = random.Random(12)
    batch_id, claims = await store_batch(db, groups=episodes, samples=1, claim=episodes)
    for claim in claims:
        assert await finish_episode(db.sessionmaker, "tests", claim.id, claim.attempt, result(rng, 100))
    return batch_id


async def test_the_snapshot_decides_what_is_sent_and_is_released(db: Database) -> None:
    batch_id, claims = await store_batch(db, groups=3, samples=1, claim=3)
    rng = random.Random(13)
    for claim in claims[:2]:
        assert await finish_episode(db.sessionmaker, "tests", claim.id, claim.attempt, result(rng, 10))
    checked_out = db.engine.pool.checkedout()
    rows = await open_batch_rows(db, batch_id, chunk_bytes=1)  # an episode a chunk
    assert rows is not None and rows.head.complete_groups == {0: 1, 1: 1}
    # Finished after the pull began: not part of it.
    assert await finish_episode(db.sessionmaker, "tests", claims[2].id, claims[2].attempt, result(rng, 10))
    chunks = [chunk async for chunk in rows.chunks()]
    assert [list(chunk.group_index) for chunk in chunks] == [[0], [1]]
    await rows.aclose()
    await rows.aclose()
    assert db.engine.pool.checkedout() == checked_out
    assert await open_batch_rows(db, "nope") is None
    assert db.engine.pool.checkedout() == checked_out


async def respond(response: BatchStreamResponse, disconnect_after: int | None) -> list[Message]:
    """Runs the response as a server would; the client goes away after `disconnect_after` body
    messages (None: it reads to the end)."""
    sent: list[Message] = []
    gone = asyncio.Event()

    async def receive() -> Message:
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        sent.append(message)
        if disconnect_after is not None and len(sent) > disconnect_after:
            gone.set()
        await asyncio.sleep(0)

    scope = {"type": "http", "asgi": {"spec_version": "2.3"}, "method": "GET"}
    await response(scope, receive, send)
    return sent


async def test_a_client_that_goes_away_mid_stream_releases_the_snapshot(db: Database) -> None:
    batch_id = await finished_batch(db, episodes=6)
    checked_out = db.engine.pool.checkedout()

    rows = await open_batch_rows(db, batch_id, chunk_bytes=1)
    assert rows is not None
    whole = await respond(arrow_stream(rows), disconnect_after=None)
    assert whole[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    table, record_batches = read_stream(b"".join(bytes(message.get("body", b"")) for message in whole))
    assert table.num_rows == 6 and record_batches == 6
    assert db.engine.pool.checkedout() == checked_out

    rows = await open_batch_rows(db, batch_id, chunk_bytes=1)
    assert rows is not None
    cut = await respond(arrow_stream(rows), disconnect_after=2)
    assert len(cut) < len(whole) and cut[-1].get("more_body")
    assert db.engine.pool.checkedout() == checked_out


def assert_matches_stored(entries: list[dict[str, Any]], stored: list[Any], fields: Iterable[str]) -> None:
    assert [entry["id"] for entry in entries] == [episode.id for episode in stored]
    for entry, episode in zip(entries, stored, strict=True):
        # Against the single-episode view, which reads the same row through the ORM.
        detail = episode_detail(episode).model_dump(mode="json")
        assert entry == {name: detail[name] for name in fields}


async def test_json_token_pull_streams_chunk_by_chunk_with_exact_values(db: Database) -> None:
    batch_id = await finished_batch(db, episodes=5)
    rows = await open_batch_rows(db, batch_id, chunk_bytes=1)  # an episode a chunk
    assert rows is not None
    sent = await respond(tokens_json_stream(rows), disconnect_after=None)
    bodies = [bytes(message.get("body", b"")) for message in sent if message.get("body")]
    assert len(bodies) >= 2 + 5  # the head, a piece per episode, the tail: it was streamed
    body = json.loads(b"".join(bodies))
    assert (body["total"], body["finished"], body["complete"], body["groups_complete"]) == (5, 5, True, 5)
    async with db.sessionmaker() as session:
        stored = await load_batch_episodes(session, batch_id)
    assert_matches_stored(body["episodes"], stored, EpisodeWithTokens.model_fields)


async def test_summaries_encode_each_complete_group_once(db: Database) -> None:
    batch_id, claims = await store_batch(db, groups=3, samples=2, claim=6)
    rng = random.Random(14)
    summaries = GroupSummaries()

    async def poll() -> dict[str, Any]:
        rows = await open_batch_rows(db, batch_id)
        assert rows is not None
        try:
            return dict(json.loads(await batch_summary_json(rows, summaries)))
        finally:
            await rows.aclose()

    for claim in claims[:3]:  # group 0 whole, group 1 half
        assert await finish_episode(db.sessionmaker, "tests", claim.id, claim.attempt, result(rng, 10))
    first = await poll()
    assert (first["groups_complete"], first["finished"], first["counts"]["running"]) == (1, 3, 3)
    assert set(summaries.of(batch_id)) == {0}
    summaries.add(batch_id, {0: summaries.of(batch_id)[0].replace(b'"reward":', b'"reward":0.0,"x":')})
    assert "x" in (await poll())["episodes"][0]  # group 0 came from the cache, not the database
    summaries = GroupSummaries()
    await poll()
    for claim in claims[3:]:
        assert await finish_episode(db.sessionmaker, "tests", claim.id, claim.attempt, result(rng, 10))
    whole = await poll()  # a whole batch is forgotten: its trainer has what it waited for
    assert len(whole["episodes"]) == 6 and summaries.of(batch_id) == {}
    async with db.sessionmaker() as session:
        stored = await load_batch_episodes(session, batch_id)
    assert_matches_stored((await poll())["episodes"], stored, EpisodeSummary.model_fields)


def test_group_summaries_keep_the_recently_polled_batches_within_their_bound() -> None:
    summaries = GroupSummaries(max_bytes=100)
    summaries.add("a", {0: b"x" * 60})
    summaries.add("b", {0: b"y" * 30})
    assert summaries.of("a")  # a is now the most recently polled
    summaries.add("c", {0: b"z" * 30})
    assert summaries.of("b") == {} and summaries.of("a") and summaries.of("c")


def test_token_versions_column_and_a_damaged_record() -> None:
    """Each sampled token gets its call's version, context tokens null; a record whose counts do
    not match its mask spoils only its own episode's column."""
    from service.api.arrow import _token_versions_column

    masks = [bytes([1, 1, 0, 1]), bytes([0, 1, 1]), bytes([1, 0])]
    turns = [
        [{"weight_version": "1", "output_tokens": 2}, {"weight_version": "2", "output_tokens": 1}],
        [{"weight_version": None, "output_tokens": 1}, {"weight_version": "2", "output_tokens": 1}],
        [{"weight_version": "3", "output_tokens": 1}],
    ]
    expected = [["1", "1", None, "2"], [None, None, "2"], ["3", None]]
    assert _token_versions_column(masks, turns).to_pylist() == expected
    turns[1][0]["output_tokens"] = 5  # damaged: more outputs than sampled tokens
    column = _token_versions_column(masks, turns).to_pylist()
    assert column[0] == expected[0] and column[2] == expected[2]
