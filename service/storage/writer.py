"""The process's one database writer: every write shares one connection and commits in groups.

Thousands of episodes in flight each storing a result, renewing leases and claiming work would
otherwise open as many write transactions at once: on SQLite they queue for the file's single
write lock (`database is locked`, pool timeouts, late lease renewals), on PostgreSQL they fill the
pool and each pays its own commit. Here a write is a block of statements run, one block at a time,
inside the current group transaction (under a savepoint, so a refused block rolls back alone; or
without one: a single statement, `execute`, and a batch, WriteBatches); the group commits
WRITE_WINDOW_SECONDS after its first block, or at once when MAX_GROUP_BLOCKS joined it, and every
block's caller returns once its group committed. Readers use their own connections and never wait
behind it.

Writes of one kind that reach the writer while it is busy run by one block (WriteBatches): the
results of finished episodes (service/storage/results.py), and, where the driver runs an
UPDATE ... RETURNING for many parameter sets (SQLite's, service/storage/sqlite_driver.py), the
single statements of `execute`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from functools import partial
from typing import Any, Generic, Protocol, TypeVar

from sqlalchemy import Delete, Executable, Row, Update
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from service.storage.errors import is_transient

logger = logging.getLogger(__name__)

WRITE_WINDOW_SECONDS = 0.005  # a group commits this long after its first block
MAX_GROUP_BLOCKS = 512  # or as soon as this many blocks joined it

Item = TypeVar("Item")
Outcome = TypeVar("Outcome")
_StatementKey = tuple[Executable, frozenset[str]]  # a statement, and the names of its parameters


class Transactions(Protocol):
    """What the queue's writes run in: `async with transactions.begin() as session:`, committed
    when the block ends (a sessionmaker, or the Writer)."""

    def begin(self) -> AbstractAsyncContextManager[AsyncSession]: ...


class _Group:
    """One group transaction: its session, how many blocks ran in it, and its commit's outcome."""

    def __init__(self, session: AsyncSession) -> None:
        self.session = session
        self.blocks = 0
        self.full = asyncio.Event()
        self.lost = False  # a block was cut off mid-statement: the group rolls back whole
        self.committed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # Callers read the outcome; if none is left to (all cancelled), it is not an error.
        self.committed.add_done_callback(lambda future: future.cancelled() or future.exception())


class Writer:
    def __init__(
        self,
        sessionmaker: async_sessionmaker[AsyncSession],
        *,
        window_seconds: float = WRITE_WINDOW_SECONDS,
        max_group_blocks: int = MAX_GROUP_BLOCKS,
    ) -> None:
        self._sessionmaker = sessionmaker
        self._window_seconds = window_seconds
        self._max_group_blocks = max_group_blocks
        self._turn = asyncio.Lock()  # one block (or commit) at a time on the connection
        bind = sessionmaker.kw.get("bind")
        self._sqlite = bind is not None and bind.dialect.name == "sqlite"
        self._group: _Group | None = None
        self._commits: set[asyncio.Task[None]] = set()
        self._closed = False
        # The statements whose rows of each parameter set the driver returns when run for many
        # (service/storage/db.py says so of SQLite's UPDATEs and DELETEs): `execute` batches those.
        self._batched: tuple[type[Update | Delete], ...] = ()
        if bind is not None:
            dialect = bind.dialect
            self._batched = tuple(
                kind
                for kind, many_returning in (
                    (Update, dialect.update_executemany_returning),
                    (Delete, dialect.delete_executemany_returning),
                )
                if many_returning
            )
        self._batches: dict[_StatementKey, WriteBatches[Mapping[str, Any], list[Row[Any]]]] = {}

    @property
    def statements_fail_alone(self) -> bool:
        """Whether a statement that fails leaves the group's transaction as it was (SQLite: its
        statement journal), so a block of one statement needs no savepoint to fail alone. On
        PostgreSQL a statement that fails aborts the whole transaction."""
        return self._sqlite

    def begin(self, *, savepoint: bool = True) -> AbstractAsyncContextManager[AsyncSession]:
        """A block of writes; returns once they are committed (raises if the commit failed).
        A block that raises is rolled back alone and its error is raised to its caller.
        `savepoint=False`: a block of one statement, a batch (WriteBatches), or one whose caller
        opens its own savepoint; it fails as `execute` does (alone on SQLite; on PostgreSQL with
        its group)."""
        if savepoint:
            return self._block(savepoint=True)
        return self._block(savepoint=False, lose_on_error=not self._sqlite)

    async def execute(self, statement: Executable, parameters: Mapping[str, Any]) -> list[Row[Any]]:
        """A block of one Core statement, without the block's savepoint; its rows, once committed.
        On SQLite a statement that fails rolls back alone and leaves the transaction open (its
        statement journal), as under a savepoint. On PostgreSQL a statement that fails aborts the
        whole transaction: its group is lost (rolled back now, its other blocks' callers get a
        retryable error, as when a commit fails), and its caller gets the statement's error. So it
        is for statements that only a database failure fails, not their values (the hot path's
        writes of agents' episodes: ids, tokens, their checked messages). Hand-written on a
        measured hot path: a savepoint and its release were two of each such write's three
        statements, and most of its CPU (in-process, 1,000 concurrent writes: SQLite 0.45 ms a
        write against 1.0 ms with them, PostgreSQL 0.27 ms against 1.0 ms).

        Where the driver returns each parameter set's rows of an UPDATE or DELETE run for many
        (SQLite's), the executes of one UPDATE or DELETE with the same parameter names that reach
        the writer while it is busy run as one executemany, in the order they came, each caller
        given its own parameter set's rows: each is still its own statement, fenced by its own
        WHERE. Hand-written on a measured hot path too: an agent-driven episode made 3.5 such
        writes, each a SQLAlchemy execution of its own, and storage was half the service's CPU per
        call (bench/verifiers_envs.py, profiled)."""
        if not isinstance(statement, self._batched):
            return await self._execute_alone(statement, parameters)
        key = (statement, frozenset(parameters))
        batches = self._batches.get(key)
        if batches is None:

            async def many(session: AsyncSession, each: list[Mapping[str, Any]]) -> list[list[Row[Any]]]:
                return await _execute_many(session, statement, each)

            async def alone(parameters: Mapping[str, Any]) -> list[Row[Any]]:
                return await self._execute_alone(statement, parameters)

            batches = self._batches[key] = WriteBatches(self, "database writes", many, alone, atomic=True)
            batches.on_idle = partial(self._forget, key, batches)
        return await batches.write(parameters)

    def _forget(self, key: _StatementKey, batches: WriteBatches[Any, Any]) -> None:
        """Drops a statement's batches once none waits: statements built per call are not kept."""
        if self._batches.get(key) is batches:
            del self._batches[key]

    async def _execute_alone(self, statement: Executable, parameters: Mapping[str, Any]) -> list[Row[Any]]:
        async with self.begin(savepoint=False) as session:
            connection = await session.connection()
            result = await connection.execute(statement, parameters)
            rows = list(result.all()) if result.returns_rows else []
        return rows

    @asynccontextmanager
    async def _block(self, *, savepoint: bool, lose_on_error: bool = False) -> AsyncIterator[AsyncSession]:
        async with self._turn:
            if self._closed:
                raise RuntimeError("the database writer is closed")
            group = self._group
            if group is None:
                group = self._group = await self._open_group()
            group.blocks += 1
            if group.blocks >= self._max_group_blocks:
                group.full.set()
            try:
                async with group.session.begin_nested() if savepoint else nullcontext():
                    yield group.session
            except BaseException as error:
                # A block cut off mid-statement (its task cancelled: a loop stopped, an episode
                # cancelled) leaves the connection invalidated, which no savepoint rolls back. The
                # group is lost: it rolls back whole, its blocks' callers get a retryable error, and
                # the next block opens a new group rather than failing in this one.
                lost = await _connection_lost(group.session)
                if not lost and not lose_on_error:
                    raise
                await self._lose(group)
                if isinstance(error, asyncio.CancelledError) or not lost:
                    raise
                raise _group_lost() from error
        await asyncio.shield(group.committed)

    async def _lose(self, group: _Group) -> None:
        """Rolls the group back now, before the next block opens one: on SQLite its transaction
        holds the write lock until then. Its commit task then fails its blocks."""
        group.lost = True
        if self._group is group:
            self._group = None
        await _rollback_quietly(group.session)
        group.full.set()

    async def _open_group(self) -> _Group:
        session = self._sessionmaker()
        try:
            await session.begin()
        except BaseException:
            await session.close()
            raise
        group = _Group(session)
        commit = asyncio.create_task(self._commit_after_window(group), name="database group commit")
        self._commits.add(commit)
        commit.add_done_callback(self._commits.discard)
        return group

    async def _commit_after_window(self, group: _Group) -> None:
        try:
            async with asyncio.timeout(self._window_seconds):
                await group.full.wait()
        except TimeoutError:
            pass
        await self._commit(group)

    async def _commit(self, group: _Group) -> None:
        async with self._turn:  # after the block under way, before any new one
            if self._group is group:
                self._group = None
            try:
                if group.lost:
                    raise _group_lost()
                await group.session.commit()
            except Exception as error:  # every block of the group failed with it: their callers retry
                group.committed.set_exception(error)
                await _rollback_quietly(group.session)
            else:
                group.committed.set_result(None)
            finally:
                await group.session.close()

    async def aclose(self) -> None:
        """Commits the group under way; later writes raise."""
        self._closed = True
        if self._commits:
            await asyncio.gather(*self._commits, return_exceptions=True)


async def _execute_many(
    session: AsyncSession, statement: Executable, parameters: list[Mapping[str, Any]]
) -> list[list[Row[Any]]]:
    """Each parameter set's rows of `statement` run for each (one executemany, all or nothing:
    sqlite_driver.py), in order."""
    connection = await session.connection()
    if len(parameters) == 1:
        result = await connection.execute(statement, parameters[0])
        return [list(result.all()) if result.returns_rows else []]
    result = await connection.execute(statement, parameters)
    if not result.returns_rows:
        return [[] for _ in parameters]
    rows = list(result.all())
    counts: list[int] = result.context.cursor.returned_per_parameters  # our driver's (sqlite_driver.py)
    each, start = [], 0
    for count in counts:
        each.append(rows[start : start + count])
        start += count
    return each


class WriteBatches(Generic[Item, Outcome]):
    """Writes of one kind through `writer`, those that reach it while it is busy written by one block
    (`many`: their outcomes, in order) rather than a block each (`one`). A write still returns only
    once it is committed. A batch that fails as a whole for a reason a retry may clear (an outage, a
    lost group) fails every caller's write, which each retries; any other failure of the batch (one
    item the database refuses, a value that cannot be encoded) is not the others' to share: the
    batch falls back to `one` per item, so each caller gets its own outcome. A batch runs without
    the block's savepoint, as `Writer.execute`'s statement does: on SQLite, where a statement that
    fails fails alone, a batch of several runs under a savepoint of its own unless `many` writes
    all of it or nothing by itself (`atomic`); on PostgreSQL a batch that fails loses its group
    (rolled back whole: its other blocks' callers get a retryable error, as when a commit fails), so
    nothing of it is written. Hand-written on a measured hot path: the savepoint and its release
    were two of the three statements of most result batches on PostgreSQL, and without them the
    service's CPU per turn at 2,000 in flight fell by 8% (bench/concurrency.py, 6 alternated pairs).
    `on_idle`, if set, is called when a batch was written and no other waits."""

    def __init__(
        self,
        writer: Writer,
        name: str,
        many: Callable[[AsyncSession, list[Item]], Awaitable[list[Outcome]]],
        one: Callable[[Item], Awaitable[Outcome]],
        *,
        atomic: bool = False,
    ) -> None:
        self._writer = writer
        self._name = name
        self._many = many
        self._one = one
        self._atomic = atomic
        self.on_idle: Callable[[], None] | None = None
        self._waiting: list[tuple[Item, asyncio.Future[Outcome]]] = []
        self._flushing: set[asyncio.Task[None]] = set()
        self._collecting = False  # a flush waits for its turn at the writer: writes join it

    async def write(self, item: Item) -> Outcome:
        future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self._waiting.append((item, future))
        if not self._collecting:
            self._collecting = True
            flush = asyncio.create_task(self._flush(), name=self._name)
            self._flushing.add(flush)
            flush.add_done_callback(self._flushing.discard)
        return await future

    def _take(self) -> list[tuple[Item, asyncio.Future[Outcome]]]:
        batch, self._waiting = self._waiting, []
        self._collecting = False
        return batch

    async def _flush(self) -> None:
        batch: list[tuple[Item, asyncio.Future[Outcome]]] | None = None
        try:
            try:
                async with self._writer.begin(savepoint=False) as session:
                    # Taken once the writer's turn came: what arrived meanwhile is in this batch.
                    batch = self._take()
                    items = [item for item, _ in batch]
                    savepoint = self._writer.statements_fail_alone and len(items) > 1 and not self._atomic
                    async with session.begin_nested() if savepoint else nullcontext():
                        outcomes = await self._many(session, items)
            except Exception as error:
                if batch is None:  # the block never opened (the writer is closed, or its group failed)
                    batch = self._take()
                if len(batch) > 1 and not is_transient(error):
                    logger.warning("%d %s together failed (%r): one by one", len(batch), self._name, error)
                    await self._one_by_one(batch)
                else:
                    for _, future in batch:
                        _settle(future, error=error)
            else:
                for (_, future), outcome in zip(batch, outcomes, strict=True):
                    _settle(future, outcome)
        finally:  # cancelled (the loop ends): no caller waits forever
            for _, future in batch if batch is not None else self._take():
                future.cancel()
            if not self._collecting and self.on_idle is not None:
                self.on_idle()

    async def _one_by_one(self, batch: list[tuple[Item, asyncio.Future[Outcome]]]) -> None:
        for item, future in batch:
            try:
                outcome = await self._one(item)
            except Exception as error:
                _settle(future, error=error)
            else:
                _settle(future, outcome)


def _settle(future: asyncio.Future[Outcome], outcome: Any = None, *, error: Exception | None = None) -> None:
    if future.done():  # its caller was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(outcome)


def _group_lost() -> OperationalError:
    """What a lost group's blocks raise: a database error their callers retry, as for a dropped
    connection (nothing of the group was committed)."""
    return OperationalError(
        "COMMIT", None, RuntimeError("a write of its group was cut off mid-statement; nothing was committed")
    )


async def _connection_lost(session: AsyncSession) -> bool:
    try:
        connection = await session.connection()  # the group's, already open: no I/O
    except Exception:
        return True
    return connection.invalidated


async def _rollback_quietly(session: AsyncSession) -> None:
    try:
        await session.rollback()
    except Exception:  # the connection is gone; closing the session discards it
        logger.debug("rollback after a failed group commit failed", exc_info=True)
