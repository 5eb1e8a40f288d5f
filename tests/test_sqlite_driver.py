"""The SQLite engine's aiosqlite adapter: one trip to the connection's thread per statement, with
the rows, counts, errors and transactions of SQLAlchemy's own adapter; and an UPDATE ... RETURNING
run for many parameter sets, which SQLAlchemy's own adapter refuses."""

from __future__ import annotations

import sqlite3
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiosqlite
import pytest
from sqlalchemy import bindparam, column, table, text, update
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine

from service.storage.db import make_engine
from service.storage.sqlite_driver import OneTripConnection


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[AsyncEngine]:
    engine = make_engine(f"sqlite+aiosqlite:///{tmp_path / 'driver.db'}")
    async with engine.begin() as connection:
        await connection.execute(text("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT UNIQUE)"))
    yield engine
    await engine.dispose()


@pytest.fixture
def trips(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """Calls run on aiosqlite's thread, by the name of the function run."""
    counted: Counter[str] = Counter()
    run = aiosqlite.Connection._execute

    async def execute(self: aiosqlite.Connection, fn: Any, *args: Any, **kwargs: Any) -> Any:
        counted[getattr(fn, "__name__", repr(fn))] += 1
        return await run(self, fn, *args, **kwargs)

    monkeypatch.setattr(aiosqlite.Connection, "_execute", execute)
    yield counted


async def test_rows_counts_and_ids_are_sqlalchemys(engine: AsyncEngine) -> None:
    async with engine.begin() as connection:
        inserted = await connection.execute(text("INSERT INTO t (v) VALUES (:v)"), {"v": "a"})
        assert (inserted.lastrowid, inserted.rowcount) == (1, 1)
        many = await connection.execute(text("INSERT INTO t (v) VALUES (:v)"), [{"v": "b"}, {"v": "c"}])
        assert many.rowcount == 2
        rows = await connection.execute(text("SELECT id, v FROM t ORDER BY id"))
        assert list(rows.keys()) == ["id", "v"]
        assert rows.all() == [(1, "a"), (2, "b"), (3, "c")]
        returned = await connection.execute(text("UPDATE t SET v = v || '!' WHERE id > 1 RETURNING id"))
        assert sorted(returned.scalars()) == [2, 3]
        assert (await connection.execute(text("DELETE FROM t WHERE id = 1"))).rowcount == 1
        assert (await connection.execute(text("SELECT v FROM t WHERE id = 99"))).first() is None
    async with engine.connect() as connection:
        assert type(connection.sync_connection.connection.dbapi_connection) is OneTripConnection  # type: ignore[union-attr]
        assert (await connection.execute(text("SELECT group_concat(v) FROM t"))).scalar() == "b!,c!"


async def test_a_statement_is_one_trip_and_an_idle_rollback_none(
    engine: AsyncEngine, trips: Counter[str]
) -> None:
    async with engine.connect() as connection:
        await connection.exec_driver_sql("SELECT 1")  # autobegins: BEGIN, sent with the statement
        trips.clear()
        for _ in range(3):
            await connection.execute(text("SELECT * FROM t"))
        assert trips == {"_run_statement": 3}
        await connection.rollback()  # a transaction is open: rolled back on the thread
        assert trips["rollback"] == 1
    trips.clear()
    async with engine.connect():  # checked out and returned without a statement: nothing to roll back
        pass
    assert trips["rollback"] == 0


async def test_a_transaction_begins_in_its_first_statements_trip(
    engine: AsyncEngine, trips: Counter[str], tmp_path: Path
) -> None:
    """BEGIN IMMEDIATE goes with the transaction's first statement, in its trip, and takes the
    write lock there; a transaction that runs no statement sends nothing, not even its commit."""
    async with engine.begin() as connection:
        trips.clear()
        await connection.execute(text("INSERT INTO t (v) VALUES ('a')"))
        assert trips == {"_run_statement": 1}
        other = sqlite3.connect(tmp_path / "driver.db", timeout=0)
        try:
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                other.execute("BEGIN IMMEDIATE")
        finally:
            other.close()
    assert trips == {"_run_statement": 1, "commit": 1}
    trips.clear()
    async with engine.begin():
        pass
    assert trips == {}
    async with engine.connect() as connection:  # the insert was committed
        assert (await connection.execute(text("SELECT v FROM t"))).scalars().all() == ["a"]


async def test_errors_are_sqlalchemys_and_roll_back(engine: AsyncEngine) -> None:
    async with engine.begin() as connection:
        await connection.execute(text("INSERT INTO t (v) VALUES ('x')"))
    with pytest.raises(IntegrityError):
        async with engine.begin() as connection:
            await connection.execute(text("INSERT INTO t (v) VALUES ('y')"))
            await connection.execute(text("INSERT INTO t (v) VALUES ('x')"))
    with pytest.raises(OperationalError, match="no such table"):
        async with engine.connect() as connection:
            await connection.execute(text("SELECT * FROM missing"))
    async with engine.connect() as connection:
        assert (await connection.execute(text("SELECT v FROM t"))).scalars().all() == ["x"]


async def test_an_update_returning_run_for_many_gives_each_sets_rows_in_one_trip_all_or_nothing(
    engine: AsyncEngine, trips: Counter[str]
) -> None:
    """What Writer.execute batches on: the sets run in order (each sees the ones before it), the
    rows of each are told apart, and a set that fails leaves none of the others' writes."""
    t = table("t", column("id"), column("v"))
    rename = update(t).where(t.c.v == bindparam("was")).values(v=bindparam("new")).returning(t.c.id, t.c.v)
    async with engine.begin() as connection:
        await connection.execute(text("INSERT INTO t (v) VALUES (:v)"), [{"v": "a"}, {"v": "b"}])
        trips.clear()
        renames = [("a", "a2"), ("none", "x"), ("a2", "a3"), ("b", "b2")]
        result = await connection.execute(rename, [{"was": was, "new": new} for was, new in renames])
        assert trips == {"_run_statement": 1}
        assert result.all() == [(1, "a2"), (1, "a3"), (2, "b2")]
        assert result.context.cursor.returned_per_parameters == [1, 0, 1, 1]
        with pytest.raises(IntegrityError):  # the second set's value is the first's (v is UNIQUE)
            await connection.execute(rename, [{"was": "a3", "new": "c"}, {"was": "b2", "new": "c"}])
        values = await connection.execute(text("SELECT v FROM t ORDER BY id"))
        assert values.scalars().all() == ["a3", "b2"]
