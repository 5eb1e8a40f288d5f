"""The process's one database writer, on both backends: group commits on one connection, a refused
block rolled back alone, and a caller that returns only once its writes are committed."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Coroutine, Iterator
from typing import Any

import pytest
from sqlalchemy import bindparam, event, func, select, text, update
from sqlalchemy.exc import IntegrityError, OperationalError

from service.records import EpisodeRequest
from service.storage.batches import NewBatch, NewEpisode, enqueue_batch
from service.storage.db import Database
from service.storage.models import Batch, Episode
from service.storage.writer import Writer


def new_batch(episodes: int = 1) -> NewBatch:
    request = EpisodeRequest("builtin/shop", "test", 0, {}, max_turns=1)
    return NewBatch(
        batch_id=f"b-{uuid.uuid4().hex[:8]}",
        request_hash="h",
        env="builtin/shop",
        task_split="test",
        metadata={},
        episodes=[NewEpisode(index, 0, request) for index in range(episodes)],
    )


async def batches_stored(db: Database) -> int:
    async with db.reader() as session:
        return int(await session.scalar(select(func.count()).select_from(Batch)) or 0)


async def test_concurrent_writes_share_one_connection_and_few_commits(db: Database) -> None:
    connections: set[int] = set()
    commits = 0

    def on_checkout(dbapi_connection: object, record: object, proxy: object) -> None:
        connections.add(id(dbapi_connection))

    def on_commit(connection: object) -> None:
        nonlocal commits
        commits += 1

    event.listen(db.engine.sync_engine, "checkout", on_checkout)
    event.listen(db.engine.sync_engine, "commit", on_commit)
    writer = Writer(db.sessionmaker, window_seconds=0.05)
    try:

        async def write() -> None:
            async with writer.begin() as session:
                await enqueue_batch(session, new_batch())

        await asyncio.gather(*(write() for _ in range(100)))
    finally:
        await writer.aclose()
        event.remove(db.engine.sync_engine, "checkout", on_checkout)
        event.remove(db.engine.sync_engine, "commit", on_commit)
    assert await batches_stored(db) == 100
    assert len(connections) == 1
    assert 1 <= commits <= 10  # 100 writes in a handful of group commits


async def test_a_refused_block_rolls_back_alone(db: Database) -> None:
    writer = Writer(db.sessionmaker, window_seconds=0.05)
    taken = new_batch()
    try:
        async with writer.begin() as session:
            await enqueue_batch(session, taken)

        async def good() -> None:
            async with writer.begin() as session:
                await enqueue_batch(session, new_batch(episodes=3))

        async def duplicate() -> None:
            async with writer.begin() as session:
                await enqueue_batch(session, taken)

        outcomes = await asyncio.gather(good(), duplicate(), good(), return_exceptions=True)
    finally:
        await writer.aclose()
    assert outcomes[0] is None and outcomes[2] is None
    assert isinstance(outcomes[1], IntegrityError)
    assert await batches_stored(db) == 3
    async with db.reader() as session:
        assert await session.scalar(select(func.count()).select_from(Episode)) == 7


async def test_a_block_that_raises_writes_nothing(db: Database) -> None:
    writer = Writer(db.sessionmaker)
    try:
        with pytest.raises(ValueError, match="changed my mind"):
            async with writer.begin() as session:
                await enqueue_batch(session, new_batch())
                raise ValueError("changed my mind")
    finally:
        await writer.aclose()
    assert await batches_stored(db) == 0


async def test_a_write_is_committed_when_its_block_returns(db: Database) -> None:
    writer = Writer(db.sessionmaker, window_seconds=0.2)
    try:
        batch = new_batch()
        async with writer.begin() as session:
            await enqueue_batch(session, batch)
        async with db.reader() as session:  # another connection sees it at once
            assert await session.get(Batch, batch.batch_id) is not None
        async with writer.begin() as session:
            await session.execute(update(Batch).where(Batch.id == batch.batch_id).values(env="other"))
        async with db.reader() as session:
            assert await session.scalar(select(Batch.env).where(Batch.id == batch.batch_id)) == "other"
    finally:
        await writer.aclose()


async def test_a_closed_writer_refuses_writes(db: Database) -> None:
    writer = Writer(db.sessionmaker)
    await writer.aclose()
    with pytest.raises(RuntimeError, match="closed"):
        async with writer.begin():
            pass


# A statement still running when its caller is cancelled. On SQLite one that runs for minutes: the
# cancel must end it (aiosqlite runs it in a thread of its own, which would hold the write lock, and
# the canceller, until it ended).
LONG_STATEMENT = {
    "postgresql": "SELECT pg_sleep(2)",
    "sqlite": "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 2000000000) "
    "SELECT count(*) FROM c",
}
CANCEL_BOUND_SECONDS = 30.0  # far above a cancel's cost, even on a loaded machine


async def test_a_block_cut_off_mid_statement_loses_its_group_and_only_it(db: Database) -> None:
    """A write cancelled while its statement runs leaves the connection invalidated. Its group is
    lost: a block already in it gets a retryable OperationalError (nothing of it committed), the
    cancelled caller its CancelledError at once (the statement is ended, not waited for), and the
    next block a new group that commits (no lock is left behind)."""
    writer = Writer(db.sessionmaker, window_seconds=2.0)  # every block below would share one group
    dialect = db.url.split(":")[0].split("+")[0]
    ran = asyncio.Event()

    async def write() -> None:
        async with writer.begin() as session:
            await enqueue_batch(session, new_batch())
            ran.set()

    async def stuck() -> None:
        async with writer.begin() as session:
            await session.execute(text(LONG_STATEMENT[dialect]))

    try:
        earlier = asyncio.create_task(write())
        # Its block ran: it waits for its group's commit. (A fixed 0.1 s was outrun at load 23: the
        # stuck block opened the group, and the earlier one, behind it, committed in a new one.)
        await asyncio.wait_for(ran.wait(), CANCEL_BOUND_SECONDS)
        cut_off = asyncio.create_task(stuck())
        await statement_running(db, dialect)
        cut_off.cancel()
        with pytest.raises(asyncio.CancelledError):
            async with asyncio.timeout(CANCEL_BOUND_SECONDS):
                await cut_off
        with pytest.raises(OperationalError, match="cut off mid-statement"):
            await earlier
        await write()
    finally:
        await writer.aclose()
    assert await batches_stored(db) == 1


async def statement_running(db: Database, dialect: str) -> None:
    """Until LONG_STATEMENT runs: PostgreSQL shows it in pg_stat_activity; SQLite's runs in
    aiosqlite's thread, out of sight, and has a fixed 0.2 s to start."""
    if dialect != "postgresql":
        await asyncio.sleep(0.2)
        return
    running = text("SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND query = :query")
    async with asyncio.timeout(CANCEL_BOUND_SECONDS):
        while True:
            async with db.reader() as session:
                if await session.scalar(running, {"query": LONG_STATEMENT[dialect]}):
                    return
            await asyncio.sleep(0.01)


async def test_a_one_statement_block_returns_its_rows_and_fails_alone_or_with_its_group(db: Database) -> None:
    """Writer.execute: the statement's rows once committed. A statement that fails raises its
    error to its caller; on SQLite it rolls back alone (no savepoint: SQLite's statement journal)
    and its group commits; on PostgreSQL, which aborts the transaction, its group is lost: the
    blocks already in it get a retryable error, nothing of them committed, and later ones a new
    group that commits."""
    writer = Writer(db.sessionmaker, window_seconds=0.5)  # the blocks below share one group
    batch, taken = new_batch(), new_batch()
    try:
        async with writer.begin() as session:
            await enqueue_batch(session, batch)
            await enqueue_batch(session, taken)
        rename = update(Batch).where(Batch.id == bindparam("batch")).values(env=bindparam("env"))

        async def renamed(batch_id: str) -> list[str]:
            rows = await writer.execute(rename.returning(Batch.id), {"batch": batch_id, "env": "renamed"})
            return [row.id for row in rows]

        async def duplicate() -> None:  # the primary key of another batch
            await writer.execute(rename.values(id=taken.batch_id), {"batch": batch.batch_id, "env": "x"})

        outcomes = await asyncio.gather(
            renamed(batch.batch_id), duplicate(), renamed("no-such-batch"), renamed(taken.batch_id),
            return_exceptions=True,
        )  # fmt: skip
    finally:
        await writer.aclose()
    assert isinstance(outcomes[1], IntegrityError)
    assert outcomes[2] == [] and outcomes[3] == [taken.batch_id]
    async with db.reader() as session:
        envs = {row.id: row.env for row in await session.execute(select(Batch.id, Batch.env))}
    if db.url.startswith("sqlite"):
        assert outcomes[0] == [batch.batch_id]
        assert envs == {batch.batch_id: "renamed", taken.batch_id: "renamed"}
    else:
        assert isinstance(outcomes[0], OperationalError) and "nothing was committed" in str(outcomes[0])
        assert envs == {batch.batch_id: "builtin/shop", taken.batch_id: "renamed"}


async def while_busy(
    writer: Writer, *writes: Coroutine[Any, Any, list[Any]]
) -> list[list[Any] | BaseException]:
    """Runs `writes` together while a block holds the writer: they all reach it busy."""
    held = asyncio.Event()

    async def busy() -> None:
        async with writer.begin():
            held.set()
            await asyncio.sleep(0.05)

    blocking = asyncio.create_task(busy())
    await held.wait()
    outcomes = await asyncio.gather(*writes, return_exceptions=True)
    await blocking
    return outcomes


@pytest.fixture
def updates_run(db: Database) -> Iterator[list[bool]]:
    """Each UPDATE of batches run: whether it was an executemany."""
    runs: list[bool] = []

    def on_execute(*args: Any) -> None:
        statement, executemany = args[2], args[5]
        if statement.startswith("UPDATE batches"):
            runs.append(executemany)

    event.listen(db.engine.sync_engine, "before_cursor_execute", on_execute)
    yield runs
    event.remove(db.engine.sync_engine, "before_cursor_execute", on_execute)


RENAME = (
    update(Batch)
    .where(Batch.id == bindparam("batch"), Batch.env == bindparam("was"))
    .values(env=bindparam("env"))
    .returning(Batch.id, Batch.env)
)


async def test_executes_of_one_statement_that_find_the_writer_busy_run_as_one(
    db: Database, updates_run: list[bool]
) -> None:
    """On SQLite, whose driver gives each parameter set's rows of an UPDATE ... RETURNING run for
    many, the executes of one statement that reach the writer while it is busy run as one
    executemany, in the order they came (each sees those before it), each caller given its own
    rows. On PostgreSQL each runs alone, with the same outcomes."""
    writer = Writer(db.sessionmaker, window_seconds=0.05)
    first, second = new_batch(), new_batch()
    try:
        async with writer.begin() as session:
            await enqueue_batch(session, first)
            await enqueue_batch(session, second)
        renames = [
            (first, "builtin/shop", "one"),
            (first, "one", "two"),
            (second, "other", "x"),
            (second, "builtin/shop", "3"),
        ]
        writes = [
            writer.execute(RENAME, {"batch": b.batch_id, "was": was, "env": env}) for b, was, env in renames
        ]
        outcomes = await while_busy(writer, *writes)
    finally:
        await writer.aclose()
    assert outcomes == [[(first.batch_id, "one")], [(first.batch_id, "two")], [], [(second.batch_id, "3")]]
    assert updates_run == ([True] if db.url.startswith("sqlite") else [False] * 4)


async def test_a_batch_with_a_refused_write_runs_one_by_one_and_only_that_write_fails(
    db: Database, updates_run: list[bool]
) -> None:
    """A batch that the database refuses (one write's value) writes nothing, then each of its writes
    runs alone: the refused one fails with its error, the others are stored."""
    if not db.url.startswith("sqlite"):
        pytest.skip("PostgreSQL's driver runs each execute alone: its failures are the one-statement test's")
    writer = Writer(db.sessionmaker, window_seconds=0.05)
    batches = [new_batch() for _ in range(3)]
    try:
        async with writer.begin() as session:
            for batch in batches:
                await enqueue_batch(session, batch)
        envs = ["one", None, "three"]  # env is NOT NULL
        params = [
            {"batch": b.batch_id, "was": "builtin/shop", "env": env}
            for b, env in zip(batches, envs, strict=True)
        ]
        outcomes = await while_busy(writer, *(writer.execute(RENAME, each) for each in params))
    finally:
        await writer.aclose()
    assert outcomes[0] == [(batches[0].batch_id, "one")] and outcomes[2] == [(batches[2].batch_id, "three")]
    assert isinstance(outcomes[1], IntegrityError)
    assert updates_run == [True, False, False, False]
    async with db.reader() as session:
        stored = {row.id: row.env for row in await session.execute(select(Batch.id, Batch.env))}
    assert stored == {
        batches[0].batch_id: "one",
        batches[1].batch_id: "builtin/shop",
        batches[2].batch_id: "three",
    }
