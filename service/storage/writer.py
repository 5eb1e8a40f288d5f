"""The process's one database writer: every write shares one connection and commits in groups.

Thousands of episodes in flight each storing a result, renewing leases and claiming work would
otherwise open as many write transactions at once: on SQLite they queue for the file's single
write lock (`database is locked`, pool timeouts, late lease renewals), on PostgreSQL they fill the
pool and each pays its own commit. Here a write is a block of statements run, one block at a time,
inside the current group transaction (under a savepoint, so a refused block rolls back alone; or a
single statement without one, `execute`); the group commits WRITE_WINDOW_SECONDS after its first
block, or at once when MAX_GROUP_BLOCKS joined it, and every block's caller returns once its group
committed. Readers use their own connections and never wait behind it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from typing import Any, Protocol

from sqlalchemy import Executable, Row
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

logger = logging.getLogger(__name__)

WRITE_WINDOW_SECONDS = 0.005  # a group commits this long after its first block
MAX_GROUP_BLOCKS = 512  # or as soon as this many blocks joined it


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

    @property
    def statements_fail_alone(self) -> bool:
        """Whether a statement that fails leaves the group's transaction as it was (SQLite: its
        statement journal), so a block of one statement needs no savepoint to fail alone. On
        PostgreSQL a statement that fails aborts the whole transaction."""
        return self._sqlite

    def begin(self, *, savepoint: bool = True) -> AbstractAsyncContextManager[AsyncSession]:
        """A block of writes; returns once they are committed (raises if the commit failed).
        A block that raises is rolled back alone and its error is raised to its caller.
        `savepoint=False`: a block of one statement, or whose caller opens its own savepoint; it
        fails as `execute` does (alone on SQLite; on PostgreSQL with its group)."""
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
        write against 1.0 ms with them, PostgreSQL 0.27 ms against 1.0 ms)."""
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
