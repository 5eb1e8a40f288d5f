"""SQLAlchemy's aiosqlite adapter with one trip to the connection's thread per statement.

aiosqlite runs each call on its connection's thread, and SQLAlchemy's cursor makes four calls of
a statement (open a cursor, execute, fetch the rows, close it), each a hand-off to that thread and
a wake-up of the event loop back: 1.9 trips a turn at 2,000 episodes in flight. Here a statement
is one function run on that thread (the cursor opened, executed, fetched and closed there); a
transaction's BEGIN goes with its first statement (`begin_with_next_statement`), and a commit or
rollback with no transaction open (sqlite3 would send nothing) skips its trip. The results are
the same buffered rows SQLAlchemy's cursor fetches; server-side cursors are SQLAlchemy's own.
"""

from __future__ import annotations

import sqlite3
from collections import deque
from collections.abc import Sequence
from typing import Any

import aiosqlite
from sqlalchemy.dialects.sqlite.aiosqlite import (
    AsyncAdapt_aiosqlite_connection,
    AsyncAdapt_aiosqlite_cursor,
    AsyncAdapt_aiosqlite_dbapi,
)
from sqlalchemy.util import EMPTY_DICT
from sqlalchemy.util.concurrency import await_

# description, rows, rowcount, lastrowid, and the rows of each parameter set of an executemany that
# returns rows
_Outcome = tuple[Any, list[Any] | None, int, int | None, list[int] | None]


def _run_statement(
    connection: sqlite3.Connection, operation: str, parameters: Any, many: bool, begin: str | None
) -> _Outcome:
    """On the connection's thread: the transaction begun (`begin`, if given), the statement
    executed, its rows fetched, its cursor closed."""
    cursor = connection.cursor()
    try:
        if begin is not None:
            cursor.execute(begin)
        if many and " RETURNING " in operation:
            return _run_each(cursor, operation, parameters)
        if many:
            cursor.executemany(operation, parameters)
        elif parameters is None:
            cursor.execute(operation)
        else:
            cursor.execute(operation, parameters)
        description = cursor.description
        rows = cursor.fetchall() if description and not many else None
        return description, rows, cursor.rowcount, cursor.lastrowid, None
    finally:
        cursor.close()


def _run_each(cursor: sqlite3.Cursor, operation: str, parameters: Any) -> _Outcome:
    """A statement that returns rows, run for many parameter sets: sqlite3's executemany refuses
    one, so each set is executed in turn, and how many rows each returned is kept with the rows.
    All or nothing, under a savepoint of its own in the same trip: a set that fails leaves none of
    the others' writes behind (sqlite3's executemany would keep those before it)."""
    returned: list[Any] = []
    counts: list[int] = []
    description = None
    cursor.execute("SAVEPOINT run_each")
    try:
        for each in parameters:
            cursor.execute(operation, each)
            description = cursor.description
            rows = cursor.fetchall()
            returned += rows
            counts.append(len(rows))
    except BaseException:
        try:
            cursor.execute("ROLLBACK TO run_each")
            cursor.execute("RELEASE run_each")
        except sqlite3.Error:  # interrupted (its caller cancelled): the connection is discarded
            pass
        raise
    cursor.execute("RELEASE run_each")
    return description, returned, len(returned), None, counts


class OneTripCursor(AsyncAdapt_aiosqlite_cursor):
    """A buffered cursor whose statement is one call on aiosqlite's thread. Hand-written on a
    measured hot path: every database statement of the service on SQLite."""

    __slots__ = ("_arraysize", "_description", "_lastrowid", "_rowcount", "returned_per_parameters")

    def __init__(self, adapt_connection: AsyncAdapt_aiosqlite_connection) -> None:  # no cursor opened here
        self._adapt_connection = adapt_connection
        self._connection = adapt_connection._connection
        self._soft_closed_memoized = EMPTY_DICT
        self._rows = deque()
        self._description: Any = None
        self._rowcount = -1
        self._lastrowid: int | None = None
        self._arraysize = 1
        # An executemany that returned rows: how many rows each parameter set returned, in order.
        self.returned_per_parameters: list[int] | None = None

    @property
    def description(self) -> Any:
        return self._description

    @property
    def rowcount(self) -> int:
        return self._rowcount

    @property
    def lastrowid(self) -> int:
        return self._lastrowid  # type: ignore[return-value]  # None before an insert, as sqlite3's

    @property
    def arraysize(self) -> int:
        return self._arraysize

    @arraysize.setter
    def arraysize(self, value: int) -> None:
        self._arraysize = value

    def execute(self, operation: Any, parameters: Any = None) -> Any:
        try:
            return await_(self._run(operation, parameters, many=False))
        except Exception as error:
            self._adapt_connection._handle_exception(error)

    def executemany(self, operation: Any, seq_of_parameters: Sequence[Any]) -> Any:
        try:
            return await_(self._run(operation, seq_of_parameters, many=True))
        except Exception as error:
            self._adapt_connection._handle_exception(error)

    async def _run(self, operation: Any, parameters: Any, *, many: bool) -> None:
        connection: aiosqlite.Connection = self._connection  # type: ignore[assignment]
        adapt_connection: OneTripConnection = self._adapt_connection  # type: ignore[assignment]
        async with adapt_connection._execute_mutex:
            begin, adapt_connection.pending_begin = adapt_connection.pending_begin, None
            # aiosqlite's own hand-off to its thread (as SQLAlchemy's isolation_level setter uses it):
            # its public calls are one trip each.
            outcome: _Outcome = await connection._execute(  # type: ignore[no-untyped-call]
                _run_statement, connection._conn, operation, parameters, many, begin
            )
        self._description, rows, self._rowcount, self._lastrowid, self.returned_per_parameters = outcome
        self._rows = deque(rows) if rows else deque()

    async def _async_soft_close(self) -> None:
        """Nothing to close: the statement's cursor was closed on the thread."""

    def close(self) -> None:
        self._rows.clear()

    def nextset(self) -> None:
        raise NotImplementedError("sqlite3 has a single result set per statement")

    def setinputsizes(self, *inputsizes: Any) -> None:
        pass  # sqlite3's does nothing


class OneTripConnection(AsyncAdapt_aiosqlite_connection):
    __slots__ = ("pending_begin",)
    _cursor_cls = OneTripCursor  # type: ignore[assignment]  # a subclass of the base's cursor

    def __init__(self, dbapi: Any, connection: Any) -> None:
        super().__init__(dbapi, connection)
        self.pending_begin: str | None = None  # the BEGIN to send with the next statement

    def begin_with_next_statement(self, begin: str) -> None:
        """Begins a transaction with `begin` (BEGIN, BEGIN IMMEDIATE) in its first statement's trip,
        where it would be a trip of its own: one of a short transaction's three. A transaction that
        runs no statement sends nothing."""
        self.pending_begin = begin

    def _ending(self) -> bool:
        """Whether a transaction is open to end (its BEGIN, if never sent, is dropped). Readable
        from this thread (a flag of the connection), and no statement runs on it while its
        transaction ends."""
        self.pending_begin = None
        connection = self._connection._connection  # None once closed
        return connection is not None and connection.in_transaction

    def rollback(self) -> None:
        # sqlite3's rollback() sends nothing outside a transaction: spare the trip.
        if self._ending():
            super().rollback()

    def commit(self) -> None:
        # Nor does its commit(): a transaction whose BEGIN was never sent (no statement ran).
        if self._ending():
            super().commit()


class OneTripDBAPI(AsyncAdapt_aiosqlite_dbapi):
    """The DBAPI module SQLAlchemy's aiosqlite dialect is given (create_engine's `module`)."""

    def connect(self, *arg: Any, **kw: Any) -> OneTripConnection:
        adapted = super().connect(*arg, **kw)
        return OneTripConnection(self, adapted._connection)


def one_trip_dbapi() -> OneTripDBAPI:
    return OneTripDBAPI(aiosqlite, sqlite3)
