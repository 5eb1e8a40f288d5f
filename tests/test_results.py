"""Results stored together (service/storage/results.py), on both backends: one block for the
results that arrive together, each still fenced by its lease, and a batch that fails falls back to
one write per result so the others' results are stored."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import event, select, update
from sqlalchemy.exc import DBAPIError, OperationalError, StatementError

from service.records import EpisodeResult
from service.storage.db import Database, utcnow
from service.storage.errors import is_refused
from service.storage.models import Episode
from service.storage.queue import (
    ClaimedEpisode,
    Finished,
    claim_episodes,
    finish_episode,
    finish_episodes,
    release_episodes,
    requeue_expired,
)
from service.storage.results import ResultWrites
from service.storage.writer import Writer
from tests.test_storage import LEASE_SECONDS, enqueue, outcome


class Statements:
    """Counts the statements run on `db`'s engine, and the executemany ones among them."""

    def __init__(self, db: Database) -> None:
        self._engine = db.engine.sync_engine
        self.updates: list[int] = []  # rows per UPDATE execution
        self.savepoints = 0
        event.listen(self._engine, "before_cursor_execute", self._seen)

    def _seen(self, conn: Any, cursor: Any, statement: str, params: Any, context: Any, many: bool) -> None:
        if statement.lstrip().upper().startswith("UPDATE EPISODES"):
            self.updates.append(len(params) if many else 1)
        if statement.lstrip().upper().startswith("SAVEPOINT"):
            self.savepoints += 1

    def close(self) -> None:
        event.remove(self._engine, "before_cursor_execute", self._seen)


async def stored_rows(db: Database, ids: list[str]) -> dict[str, tuple[str, int | None]]:
    async with db.reader() as session:
        rows = await session.execute(
            select(Episode.id, Episode.status, Episode.num_turns).where(Episode.id.in_(ids))
        )
        return {row.id: (row.status, row.num_turns) for row in rows}


async def test_results_finished_together_are_stored_by_one_executemany(db: Database) -> None:
    await enqueue(db, groups=4, samples=8)
    claims = await claim_episodes(db.writer, "w1", 32, LEASE_SECONDS)
    writes = ResultWrites(db.writer, "w1")
    statements = Statements(db)
    try:
        stored = await asyncio.gather(*(writes.finish(c.id, c.attempt, outcome(length=4)) for c in claims))
    finally:
        statements.close()
    assert stored == [True] * 32
    assert statements.updates == [32]  # one statement for all 32, not 32 statements
    rows = await stored_rows(db, [c.id for c in claims])
    assert set(rows.values()) == {("completed", 1)}


async def test_a_result_alone_is_one_statement_and_fails_alone_or_with_its_group(
    db: Database, backend: str
) -> None:
    """A result stored alone runs its one UPDATE without a savepoint, as `Writer.execute` does. A
    result that cannot be stored gets its own error, nothing of it written; on SQLite (a statement
    that fails fails alone) the block that shares its group commits; on PostgreSQL its group is
    lost: that block's caller gets a retryable error, nothing of it committed, and retried it
    commits."""
    await enqueue(db, groups=1, samples=2)
    good, bad = await claim_episodes(db.writer, "w1", 2, LEASE_SECONDS)
    writer = Writer(db.sessionmaker, window_seconds=0.5)  # the blocks below share one group
    writes = ResultWrites(writer, "w1")
    statements = Statements(db)
    try:
        assert await writes.finish(good.id, good.attempt, outcome(length=4)) is True
        assert statements.savepoints == 0
        unencodable = EpisodeResult(outcome().status, 1.0, None, [], {"not json": object()})

        async def renew() -> set[str]:
            async with writer.begin() as session:
                await session.execute(update(Episode).where(Episode.id == good.id).values(lease_owner="w9"))
            return {good.id}

        refused, renewed = await asyncio.gather(
            writes.finish(bad.id, bad.attempt, unencodable), renew(), return_exceptions=True
        )
        if backend == "postgres":
            assert isinstance(renewed, OperationalError) and "nothing was committed" in str(renewed)
            renewed = await renew()
    finally:
        statements.close()
        await writer.aclose()
    # The good result, then the other block (the bad one never ran), and on PostgreSQL its retry.
    assert statements.updates == [1, 1] + ([1] if backend == "postgres" else [])
    assert isinstance(refused, StatementError) and renewed == {good.id}
    rows = await stored_rows(db, [good.id, bad.id])
    assert rows == {good.id: ("completed", 1), bad.id: ("running", None)}
    async with db.reader() as session:
        assert await session.scalar(select(Episode.lease_owner).where(Episode.id == good.id)) == "w9"


async def test_a_lost_lease_is_not_overwritten_in_a_batch(db: Database) -> None:
    await enqueue(db, groups=1, samples=5)
    claims = await claim_episodes(db.sessionmaker, "w1", 5, LEASE_SECONDS)
    released, stale, other_owner, finished_first, kept = claims
    # None of the first four is this batch's to write: one re-queued when its lease expired and
    # claimed again (attempt 1), one released back to the queue, one re-leased to another worker,
    # one already finished.
    async with db.sessionmaker.begin() as session:
        far = utcnow() + timedelta(seconds=10 * LEASE_SECONDS)
        await session.execute(update(Episode).where(Episode.id != stale.id).values(lease_expires_at=far))
    assert await requeue_expired(db.sessionmaker, 5, now=utcnow() + timedelta(seconds=2 * LEASE_SECONDS)) == 1
    (again,) = await claim_episodes(db.sessionmaker, "w1", 1, LEASE_SECONDS)
    assert (again.id, again.attempt) == (stale.id, 1)
    assert await release_episodes(db.sessionmaker, "w1", [released.id]) == 1
    async with db.sessionmaker.begin() as session:
        await session.execute(update(Episode).where(Episode.id == other_owner.id).values(lease_owner="w2"))
    first = finished_first
    assert await finish_episode(db.sessionmaker, "w1", first.id, first.attempt, outcome(length=2))

    writes = ResultWrites(db.writer, "w1")
    results = await asyncio.gather(*(writes.finish(c.id, c.attempt, outcome(length=9)) for c in claims))
    assert results == [False, False, False, False, True]
    rows = await stored_rows(db, [c.id for c in claims])
    assert rows[released.id] == ("queued", None)
    assert rows[stale.id] == ("running", None)  # attempt 1 runs on; attempt 0's result is fenced out
    assert rows[other_owner.id] == ("running", None)
    assert rows[kept.id] == ("completed", 1)
    async with db.reader() as session:
        row = await session.get(Episode, first.id)
        assert row is not None and row.status == "completed" and len(row.loss_mask or b"") == 2  # not 9
    assert await writes.finish(again.id, again.attempt, outcome()) is True  # attempt 1, under its lease


async def test_the_same_result_given_twice_is_stored_once(db: Database) -> None:
    await enqueue(db, groups=1, samples=1)
    (claim,) = await claim_episodes(db.sessionmaker, "w1", 1, LEASE_SECONDS)
    twice = [
        Finished(claim.id, claim.attempt, outcome(length=3)),
        Finished(claim.id, claim.attempt, outcome(length=7)),
    ]
    async with db.sessionmaker.begin() as session:
        assert await finish_episodes(session, "w1", twice) == [True, False]
    async with db.reader() as session:
        row = await session.get(Episode, claim.id)
        assert row is not None and len(row.loss_mask or b"") == 3


async def six_results_one_bad(
    db: Database, bad: EpisodeResult, index: int
) -> tuple[ResultWrites, list[ClaimedEpisode], list[bool | BaseException], Statements]:
    """Six claimed episodes' results written side by side, `bad` the one at `index`: the writer,
    the claims, each write's outcome (or error) and the statements it ran."""
    await enqueue(db, groups=1, samples=6)
    claims = await claim_episodes(db.writer, "w1", 6, LEASE_SECONDS)
    results = [bad if position == index else outcome(length=4) for position in range(6)]
    writes = ResultWrites(db.writer, "w1")
    statements = Statements(db)
    try:
        stored = await asyncio.gather(
            *(writes.finish(c.id, c.attempt, result) for c, result in zip(claims, results, strict=True)),
            return_exceptions=True,
        )
    finally:
        statements.close()
    return writes, claims, stored, statements


async def test_a_failing_batch_falls_back_to_one_write_per_result(db: Database) -> None:
    unencodable = EpisodeResult(outcome().status, 1.0, None, [], {"not json": object()})
    writes, claims, stored, statements = await six_results_one_bad(db, unencodable, 2)
    assert isinstance(stored[2], StatementError)  # its own error, to its own caller
    assert [value for index, value in enumerate(stored) if index != 2] == [True] * 5
    assert statements.updates == [1] * 5  # the batch failed as it was built: then one by one
    rows = await stored_rows(db, [c.id for c in claims])
    assert rows.pop(claims[2].id) == ("running", None)  # nothing of it written: still its lease's
    assert set(rows.values()) == {("completed", 1)}
    # Its caller stores what it can (the worker stores a failed result saying why): the lease holds.
    assert await writes.finish(claims[2].id, claims[2].attempt, EpisodeResult.failed("unstorable")) is True


async def test_a_batch_the_database_refuses_midway_is_rolled_back_then_stored_one_by_one(
    db: Database, backend: str
) -> None:
    if backend != "postgres":
        pytest.skip(
            "SQLite stores any JSON text; PostgreSQL's json type refuses NaN, which json.dumps writes"
        )
    refused = EpisodeResult(outcome().status, 1.0, None, [], {"reward": float("nan")})
    _, claims, stored, statements = await six_results_one_bad(db, refused, 4)
    assert isinstance(stored[4], DBAPIError) and "json" in str(stored[4])  # its own error, to its own caller
    assert is_refused(stored[4])  # so the worker stores a failed result saying why, never re-runs it
    assert [value for index, value in enumerate(stored) if index != 4] == [True] * 5
    assert statements.updates == [6] + [1] * 6  # the batch ran and was refused: then one by one
    rows = await stored_rows(db, [c.id for c in claims])
    assert rows.pop(claims[4].id) == ("running", None)
    assert set(rows.values()) == {("completed", 1)}


async def test_a_closed_writer_fails_every_waiting_result(db: Database) -> None:
    await enqueue(db, groups=1, samples=3)
    claims = await claim_episodes(db.writer, "w1", 3, LEASE_SECONDS)
    await db.writer.aclose()
    writes = ResultWrites(db.writer, "w1")
    with pytest.raises(RuntimeError, match="closed"):
        await asyncio.gather(*(writes.finish(c.id, c.attempt, outcome()) for c in claims))
    rows = await stored_rows(db, [c.id for c in claims])
    assert set(rows.values()) == {("running", None)}
