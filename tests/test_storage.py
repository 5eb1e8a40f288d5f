from __future__ import annotations

import asyncio
import json
import struct
import uuid
from dataclasses import replace
from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import Text, cast, exc, select, text

from service.records import EpisodeRequest, EpisodeResult, EpisodeStatus, EpisodeTokens, TurnRecord
from service.storage import blobs
from service.storage import db as db_module
from service.storage.batches import (
    _ANY_UNFINISHED,
    NewBatch,
    NewEpisode,
    batch_finished,
    batch_status_counts,
    enqueue_batch,
    status_counts,
)
from service.storage.db import Database, json_text, make_engine, make_sessionmaker, utcnow
from service.storage.models import Episode
from service.storage.queue import (
    any_queued,
    claim_episodes,
    finish_episode,
    release_episodes,
    renew_leases,
    requeue_expired,
)
from service.text import all_finite
from tests.support.reads import get_batch, load_batch_episodes, queue_depth
from tests.support.settings import CONNECT_TIMEOUT_SECONDS

INT32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
LEASE_SECONDS = 30.0


# --- blobs: pure ---------------------------------------------------------------------------------


@given(st.lists(INT32))
def test_ids_round_trip(ids: list[int]) -> None:
    data = blobs.encode_ids(ids)
    assert len(data) == 4 * len(ids)
    assert blobs.decode_ids(data) == ids


@given(st.lists(st.integers(min_value=0, max_value=1)))
def test_mask_round_trip(mask: list[int]) -> None:
    data = blobs.encode_mask(mask)
    assert len(data) == len(mask)
    assert blobs.decode_mask(data) == mask


@given(st.lists(st.floats(allow_nan=False)))
def test_logprobs_round_trip_exactly(logprobs: list[float]) -> None:
    assert blobs.decode_logprobs(blobs.encode_logprobs(logprobs)) == logprobs


def test_blobs_are_little_endian() -> None:
    assert blobs.encode_ids([1, -2]) == b"\x01\x00\x00\x00\xfe\xff\xff\xff"
    assert blobs.encode_mask([0, 1]) == b"\x00\x01"
    assert blobs.encode_logprobs([-0.5]) == struct.pack("<d", -0.5)


def test_blobs_refuse_bad_input() -> None:
    with pytest.raises(OverflowError):
        blobs.encode_ids([2**31])
    with pytest.raises(OverflowError):
        blobs.encode_mask([256])
    with pytest.raises(ValueError, match="whole number"):
        blobs.decode_ids(b"\x00\x00\x00")


def test_a_result_checks_the_response_arrays() -> None:
    completed, running = EpisodeStatus.COMPLETED, EpisodeStatus.RUNNING
    with pytest.raises(ValueError, match="differ in length"):
        EpisodeResult(completed, None, EpisodeTokens([1], [1, 2], [1], [0.0, 0.0]), [], {})
    with pytest.raises(ValueError, match="differ in length"):
        EpisodeResult(completed, None, EpisodeTokens([1], [1], [1], []), [], {})
    with pytest.raises(ValueError, match="finished status"):
        EpisodeResult(running, None, None, [], {})


# --- the queue, on both backends -------------------------------------------------------------------


async def enqueue(db: Database, groups: int = 2, samples: int = 2) -> str:
    batch_id = f"batch-{uuid.uuid4().hex[:8]}"
    episodes = [
        NewEpisode(
            group_index=group,
            sample_index=sample,
            request=EpisodeRequest(
                env="builtin",
                task_split="test",
                task_index=10 + group,
                sampling_params={"temperature": 1.0},
                max_turns=4,
                max_response_tokens=None if group else 256,
            ),
        )
        for group in range(groups)
        for sample in range(samples)
    ]
    async with db.sessionmaker.begin() as session:
        await enqueue_batch(
            session,
            NewBatch(
                batch_id=batch_id,
                request_hash="h" * 64,
                env="builtin",
                task_split="test",
                metadata={"step": 3},
                episodes=episodes,
            ),
        )
    return batch_id


TURN = TurnRecord(
    turn=0, weight_version="7", finish_reason={"type": "stop"}, output_tokens=3, engine_seconds=0.1
)


def outcome(length: int = 3, status: str = "completed") -> EpisodeResult:
    return EpisodeResult(
        status=EpisodeStatus(status),
        reward=1.0,
        tokens=EpisodeTokens(
            prompt_ids=[1, 2, 3],
            response_ids=list(range(100, 100 + length)),
            loss_mask=[1] * length,
            rollout_logprobs=[-0.25] * length,
        ),
        messages=[{"role": "user", "content": "hi"}],
        info={"reward_breakdown": {"r": 1.0}},
        turns=[TURN],
    )


async def test_enqueue_and_read_back(db: Database) -> None:
    batch_id = await enqueue(db, groups=3, samples=2)
    async with db.sessionmaker() as session:
        batch = await get_batch(session, batch_id)
        assert batch is not None
        assert batch.metadata_ == {"step": 3}
        assert batch.created_at.tzinfo is not None
        assert await get_batch(session, "missing") is None
        assert await queue_depth(session) == 6
        counts = await batch_status_counts(session, batch_id)
        assert counts == {
            "queued": 6, "running": 0, "completed": 0, "truncated": 0, "aborted": 0, "failed": 0,
            "cancelled": 0,
        }  # fmt: skip
        assert (await status_counts(session))["queued"] == 6
        episodes = await load_batch_episodes(session, batch_id)
        order = [(e.group_index, e.sample_index) for e in episodes]
        assert order == [(g, s) for g in range(3) for s in range(2)]
        assert all(e.status == "queued" and e.attempt == 0 and e.tokens() is None for e in episodes)


async def test_whether_a_batch_is_finished_is_read_from_its_status_index(db: Database) -> None:
    """A long-poll asks after every result stored: the check seeks the batch's unfinished episodes
    in the (batch_id, status) index, where by batch alone it read every row of the batch."""
    batch_id = await enqueue(db, groups=3, samples=2)
    async with db.sessionmaker.begin() as session:
        bind = session.get_bind()
        sql = str(
            _ANY_UNFINISHED.params(batch=batch_id).compile(bind, compile_kwargs={"literal_binds": True})
        )
        if bind.dialect.name == "postgresql":
            await session.execute(text("SET LOCAL enable_seqscan = off"))  # a table this small is scanned
            plan = "\n".join((await session.execute(text(f"EXPLAIN {sql}"))).scalars())
        else:
            plan = "\n".join(row.detail for row in await session.execute(text(f"EXPLAIN QUERY PLAN {sql}")))
    assert "ix_episodes_batch_id_status" in plan, plan
    assert not await batch_finished(db, batch_id)


async def test_a_batch_id_is_stored_once(db: Database) -> None:
    batch_id = await enqueue(db)
    with pytest.raises(exc.IntegrityError):
        async with db.sessionmaker.begin() as session:
            await enqueue_batch(
                session,
                NewBatch(
                    batch_id=batch_id, request_hash="x", env="e", task_split="s", metadata={}, episodes=[]
                ),
            )


async def test_claim_leases_oldest_first_in_group_order(db: Database) -> None:
    assert not await any_queued(db)
    first = await enqueue(db, groups=2, samples=2)
    second = await enqueue(db, groups=1, samples=1)
    assert await any_queued(db)
    before = utcnow()
    claimed = await claim_episodes(db.sessionmaker, "w1", 3, LEASE_SECONDS)
    assert [(c.batch_id, c.group_index, c.sample_index) for c in claimed] == [
        (first, 0, 0),
        (first, 0, 1),
        (first, 1, 0),
    ]
    requests = [claim.spec.request for claim in claimed]
    assert requests[0].max_response_tokens == 256 and requests[2].max_response_tokens is None
    assert requests[0].sampling_params == {"temperature": 1.0} and requests[0].task_index == 10
    rest = await claim_episodes(db.sessionmaker, "w2", 10, LEASE_SECONDS)
    assert [(c.batch_id, c.group_index) for c in rest] == [(first, 1), (second, 0)]
    assert not await any_queued(db)  # all running
    assert await claim_episodes(db.sessionmaker, "w2", 10, LEASE_SECONDS) == []
    assert await claim_episodes(db.sessionmaker, "w2", 0, LEASE_SECONDS) == []

    async with db.sessionmaker() as session:
        row = await session.get(Episode, claimed[0].id)
        assert row is not None
        assert row.status == "running" and row.lease_owner == "w1"
        assert row.lease_expires_at is not None and row.started_at is not None
        assert row.lease_expires_at - before >= timedelta(seconds=LEASE_SECONDS)
        assert row.lease_expires_at.tzinfo is not None
        assert await queue_depth(session) == 0


async def test_renew_only_owned_running_leases(db: Database) -> None:
    await enqueue(db, groups=1, samples=3)
    mine = await claim_episodes(db.sessionmaker, "w1", 2, LEASE_SECONDS)
    theirs = await claim_episodes(db.sessionmaker, "w2", 1, LEASE_SECONDS)
    later = utcnow() + timedelta(seconds=100)
    ids = {c.id for c in mine} | {theirs[0].id, "no-such-episode"}
    renewed = await renew_leases(db.sessionmaker, "w1", ids, LEASE_SECONDS, now=later)
    assert renewed == {c.id for c in mine}
    async with db.sessionmaker() as session:
        row = await session.get(Episode, mine[0].id)
        assert row is not None and row.lease_expires_at == later + timedelta(seconds=LEASE_SECONDS)
    assert await finish_episode(db.sessionmaker, "w1", mine[0].id, 0, outcome())
    assert await renew_leases(db.sessionmaker, "w1", [mine[0].id], LEASE_SECONDS) == set()
    assert await renew_leases(db.sessionmaker, "w1", [], LEASE_SECONDS) == set()


async def test_finish_stores_the_outcome_once(db: Database) -> None:
    batch_id = await enqueue(db, groups=1, samples=1)
    (claimed,) = await claim_episodes(db.sessionmaker, "w1", 1, LEASE_SECONDS)
    assert await finish_episode(db.sessionmaker, "w1", claimed.id, claimed.attempt, outcome(length=4))
    assert not await finish_episode(db.sessionmaker, "w1", claimed.id, claimed.attempt, outcome(length=9))
    async with db.sessionmaker() as session:
        (episode,) = await load_batch_episodes(session, batch_id, with_tokens=True)
        assert episode.status == "completed" and episode.reward == 1.0 and episode.num_turns == 1
        assert episode.finished_at is not None and episode.lease_expires_at is None
        assert episode.turns == [TURN.to_json()]
        assert episode.info == {"reward_breakdown": {"r": 1.0}}
        assert episode.tokens() == EpisodeTokens(
            prompt_ids=[1, 2, 3],
            response_ids=[100, 101, 102, 103],
            loss_mask=[1, 1, 1, 1],
            rollout_logprobs=[-0.25] * 4,
        )
        assert await batch_status_counts(session, batch_id) == {
            "queued": 0, "running": 0, "completed": 1, "truncated": 0, "aborted": 0, "failed": 0,
            "cancelled": 0,
        }  # fmt: skip
    async with db.sessionmaker() as session:
        (light,) = await load_batch_episodes(session, batch_id, with_tokens=False)
        assert light.reward == 1.0
        with pytest.raises(exc.InvalidRequestError):
            _ = light.response_ids


@pytest.mark.parametrize(
    "value",
    [
        "a\ud800b",  # a lone surrogate: orjson refuses it, json.dumps writes its escape
        {"id": 2**70},  # past 64 bits
        {1: "int key"},
        EpisodeStatus.COMPLETED,  # a str subclass
        {"reward": float("nan"), "content": None},  # orjson writes NaN as null, json.dumps as NaN
        [[1.0, {"x": float("-inf")}], None],
    ],
    ids=["lone-surrogate", "big-int", "int-key", "str-subclass", "nan", "infinity"],
)
def test_json_text_is_json_dumps_where_orjson_refuses(value: object) -> None:
    assert json_text(value) == json.dumps(value)


@pytest.mark.parametrize(
    ("value", "max_depth", "finite"),
    [
        ({"a": [1, "x", None, True, {"b": (2.5, -0.0)}]}, 32, True),
        ({"a": [1, {"b": (2.5, float("nan"))}]}, 32, False),  # in a tuple, as orjson writes one
        ([[float("-inf")]], 32, False),
        (float("inf"), 32, False),
        ([[[]]], 3, True),
        ([[[[]]]], 3, False),  # nested past the bound: 4 levels
        ([[[[1.0]]]], 3, False),
        (EpisodeStatus.COMPLETED, 1, True),
    ],
)
def test_all_finite_finds_nan_and_infinities_and_nesting_past_the_bound(
    value: object, max_depth: int, finite: bool
) -> None:
    assert all_finite(value, max_depth) is finite


def test_json_text_writes_what_json_dumps_reads_back_the_same() -> None:
    value = {"content": "é \x00 \U0001f600", "n": [1, -2.5, None, True], "nested": {"a": [(1e308,)]}}
    assert json.loads(json_text(value)) == json.loads(json.dumps(value))
    assert json_text(value) != json.dumps(value)  # orjson's form
    with pytest.raises(TypeError):  # a type of its own fails as it did with json.dumps
        json_text({"turn": TURN})


async def test_a_transcript_with_a_lone_surrogate_is_stored_as_before(db: Database) -> None:
    """json.dumps wrote a lone surrogate as its \\ud800 escape, which both databases store and
    read back as the same string; the JSON columns' orjson falls back to it there."""
    batch_id = await enqueue(db, groups=1, samples=1)
    (claimed,) = await claim_episodes(db.sessionmaker, "w1", 1, LEASE_SECONDS)
    messages = [{"role": "assistant", "content": "half \ud800 a pair, é"}]
    result = replace(outcome(), messages=messages)
    assert await finish_episode(db.sessionmaker, "w1", claimed.id, claimed.attempt, result)
    async with db.sessionmaker() as session:
        (episode,) = await load_batch_episodes(session, batch_id, with_tokens=False)
        assert episode.messages == messages
        stored = await session.scalar(select(cast(Episode.messages, Text)).where(Episode.id == claimed.id))
        assert stored == json.dumps(messages)


async def test_finish_with_a_stale_lease_writes_nothing(db: Database) -> None:
    await enqueue(db, groups=1, samples=1)
    (claimed,) = await claim_episodes(db.sessionmaker, "w1", 1, LEASE_SECONDS)
    assert not await finish_episode(db.sessionmaker, "w2", claimed.id, claimed.attempt, outcome())
    assert not await finish_episode(db.sessionmaker, "w1", claimed.id, claimed.attempt + 1, outcome())

    # The lease expires; the sweep re-queues it and another worker claims attempt 1.
    assert await requeue_expired(db.sessionmaker, 3, now=utcnow() + timedelta(seconds=LEASE_SECONDS + 1)) == 1
    (again,) = await claim_episodes(db.sessionmaker, "w2", 1, LEASE_SECONDS)
    assert (again.id, again.attempt) == (claimed.id, 1)
    assert not await finish_episode(db.sessionmaker, "w1", claimed.id, 0, outcome())
    assert await renew_leases(db.sessionmaker, "w1", [claimed.id], LEASE_SECONDS) == set()
    async with db.sessionmaker() as session:
        row = await session.get(Episode, claimed.id)
        assert row is not None and row.status == "running" and row.reward is None and row.response_ids is None
    assert await finish_episode(db.sessionmaker, "w2", again.id, again.attempt, outcome(status="aborted"))


async def test_expired_leases_fail_after_max_attempts(db: Database) -> None:
    await enqueue(db, groups=1, samples=1)
    max_attempts = 3
    sweeps = []
    for attempt in range(max_attempts):
        claimed_at = utcnow()
        (claimed,) = await claim_episodes(db.sessionmaker, f"w{attempt}", 1, LEASE_SECONDS, now=claimed_at)
        assert claimed.attempt == attempt
        # A sweep before the lease expires changes nothing.
        assert await requeue_expired(db.sessionmaker, max_attempts) == 0
        expired = claimed_at + timedelta(seconds=LEASE_SECONDS + 1)
        sweeps.append(await requeue_expired(db.sessionmaker, max_attempts, now=expired))
    assert sweeps == [1, 1, 1]
    assert await claim_episodes(db.sessionmaker, "w9", 1, LEASE_SECONDS) == []
    async with db.sessionmaker() as session:
        row = await session.get(Episode, claimed.id)
        assert row is not None and row.status == "failed" and row.attempt == max_attempts - 1
        assert row.failures == max_attempts
        assert row.error == "lease expired 3 times (a worker crashed or was killed); last attempt 2"
        assert row.finished_at is not None and row.lease_expires_at is None


async def test_graceful_releases_do_not_use_up_the_failure_budget(db: Database) -> None:
    """Deploys release in-flight episodes; only crashes and engine outages count as failures."""
    await enqueue(db, groups=1, samples=1)
    for attempt in range(5):  # five graceful restarts, more than max_attempts
        (claimed,) = await claim_episodes(db.sessionmaker, f"w{attempt}", 1, LEASE_SECONDS)
        assert (claimed.attempt, claimed.failures) == (attempt, 0)
        assert await release_episodes(db.sessionmaker, f"w{attempt}") == 1
    (claimed,) = await claim_episodes(db.sessionmaker, "w5", 1, LEASE_SECONDS)
    assert await release_episodes(db.sessionmaker, "w5", [claimed.id], failed=True) == 1
    (claimed,) = await claim_episodes(db.sessionmaker, "w6", 1, LEASE_SECONDS)
    assert (claimed.attempt, claimed.failures) == (6, 1)


async def test_release_requeues_own_running_episodes(db: Database) -> None:
    await enqueue(db, groups=2, samples=2)
    mine = await claim_episodes(db.sessionmaker, "w1", 3, LEASE_SECONDS)
    theirs = await claim_episodes(db.sessionmaker, "w2", 1, LEASE_SECONDS)
    assert await finish_episode(db.sessionmaker, "w1", mine[0].id, 0, outcome())
    assert await release_episodes(db.sessionmaker, "w1", [mine[0].id, mine[1].id, theirs[0].id]) == 1
    assert await release_episodes(db.sessionmaker, "w1") == 1  # the rest of w1's: mine[2]
    assert not await finish_episode(db.sessionmaker, "w1", mine[1].id, 0, outcome())
    async with db.sessionmaker() as session:
        rows = {e.id: e for e in (await session.scalars(select(Episode))).all()}
    assert rows[mine[0].id].status == "completed"
    released = rows[mine[1].id]
    assert (released.status, released.attempt, released.lease_owner) == ("queued", 1, None)
    assert rows[mine[2].id].status == "queued" and rows[mine[2].id].started_at is None
    assert rows[theirs[0].id].status == "running" and rows[theirs[0].id].lease_owner == "w2"


async def test_concurrent_claimers_never_share_an_episode(db: Database) -> None:
    total = 120
    await enqueue(db, groups=30, samples=4)
    # A second engine stands for a second process: its own connections and locks.
    other_engine = make_engine(db.url, connect_timeout=CONNECT_TIMEOUT_SECONDS)
    try:
        makers = [db.sessionmaker, make_sessionmaker(other_engine)]
        claimers = 6
        # Each claims once before any claims again, so that all of them race: one that gets the write
        # lock back to back could otherwise claim everything alone (seen once on SQLite, 1 of 6 claimers).
        first_claims_done = asyncio.Barrier(claimers)

        async def claimer(index: int) -> list[str]:
            ids = [c.id for c in await claim_episodes(makers[index % 2], f"w{index}", 1, LEASE_SECONDS)]
            await first_claims_done.wait()
            while batch := await claim_episodes(makers[index % 2], f"w{index}", 7, LEASE_SECONDS):
                ids.extend(c.id for c in batch)
            return ids

        results = await asyncio.gather(*(claimer(index) for index in range(claimers)))
    finally:
        await other_engine.dispose()
    claimed = [episode_id for ids in results for episode_id in ids]
    assert len(claimed) == total
    assert len(set(claimed)) == total
    assert all(results)  # every claimer, through both engines, took part


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
async def test_sqlite_reads_do_not_hold_the_write_lock(db: Database) -> None:
    """A trainer's long read (a big batch pull) must not block heartbeats and result writes."""
    await enqueue(db)
    async with db.reader() as reading:
        assert len((await reading.scalars(select(Episode))).all()) == 4  # its transaction is open
        async with asyncio.timeout(5):  # the write lock would otherwise wait for busy_timeout (30 s)
            await enqueue(db)
        claimed = await claim_episodes(db.sessionmaker, "w", 10, 30)
        assert len(claimed) == 8


@pytest.mark.parametrize("backend", ["postgres"])
async def test_a_pooled_postgres_connection_is_pinged_only_after_sitting_idle(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(database_url, connect_timeout=CONNECT_TIMEOUT_SECONDS)
    dialect = engine.sync_engine.dialect
    ping = dialect.do_ping
    pings = 0

    def counted(dbapi_connection: object) -> bool:
        nonlocal pings
        pings += 1
        return ping(dbapi_connection)

    monkeypatch.setattr(dialect, "do_ping", counted)
    monkeypatch.setattr(db_module, "PING_IDLE_SECONDS", 0.2)

    async def backend_pid() -> int:
        async with engine.connect() as connection:
            return int((await connection.execute(text("SELECT pg_backend_pid()"))).scalar_one())

    try:
        first = await backend_pid()  # a new connection: not pinged
        assert [await backend_pid() for _ in range(3)] == [first] * 3  # used within 0.2 s: not pinged
        assert pings == 0
        await asyncio.sleep(0.3)
        assert await backend_pid() == first
        assert pings == 1
        # Killed while idle: the ping finds it dead, and the checkout gets a new connection.
        killer = make_engine(database_url, connect_timeout=CONNECT_TIMEOUT_SECONDS)
        try:
            async with killer.connect() as other:
                await other.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": first})
        finally:
            await killer.dispose()
        await asyncio.sleep(0.3)
        assert await backend_pid() != first
        assert pings == 2
    finally:
        await engine.dispose()


async def test_batch_finished_asks_whether_an_episode_is_queued_or_running(db: Database) -> None:
    assert await batch_finished(db, "no-such-batch")
    batch_id = await enqueue(db, groups=1, samples=2)
    assert not await batch_finished(db, batch_id)  # queued
    first, second = await claim_episodes(db.sessionmaker, "w1", 2, LEASE_SECONDS)
    assert await finish_episode(db.sessionmaker, "w1", first.id, first.attempt, outcome())
    assert not await batch_finished(db, batch_id)  # one running
    assert await finish_episode(db.sessionmaker, "w1", second.id, second.attempt, outcome(status="aborted"))
    assert await batch_finished(db, batch_id)


@pytest.mark.parametrize("backend", ["postgres"])
@pytest.mark.parametrize("pooler", [False, True], ids=["direct", "transaction-pooler"])
async def test_single_reads_run_outside_a_transaction_on_postgres(database_url: str, pooler: bool) -> None:
    """No BEGIN and ROLLBACK around a one-statement read, but behind a transaction-mode pooler,
    which may run a statement's prepare and execution on two server connections outside one."""
    database = Database.open(database_url, connect_timeout=CONNECT_TIMEOUT_SECONDS, transaction_pooler=pooler)
    try:
        async with database.single_reads.connect() as connection:
            await connection.execute(text("SELECT 1"))
            raw = (await connection.get_raw_connection()).driver_connection
            assert raw is not None and raw.is_in_transaction() is pooler
        async with database.read_only.connect() as connection:  # the readers' snapshots are kept
            await connection.execute(text("SELECT 1"))
            raw = (await connection.get_raw_connection()).driver_connection
            assert raw is not None and raw.is_in_transaction()
    finally:
        await database.dispose()
