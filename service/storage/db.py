"""Engines, session makers and migrations for SQLite (aiosqlite) and PostgreSQL (asyncpg)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
from alembic import command
from alembic.config import Config
from sqlalchemy import ColumnElement, ColumnExpressionArgument, Connection, event, func, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import InvalidatePoolError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.pool import NullPool

from service.storage.sqlite_driver import OneTripConnection, one_trip_dbapi
from service.storage.writer import Writer
from service.text import all_finite

REPO_DIR = Path(__file__).resolve().parents[2]
ALEMBIC_INI = REPO_DIR / "alembic.ini"
MIGRATIONS_DIR = REPO_DIR / "migrations"

# How long a SQLite connection waits for another writer before "database is locked".
SQLITE_BUSY_TIMEOUT_MS = 30_000
POSTGRES_POOL_SIZE = 10
POSTGRES_MAX_OVERFLOW = 20
POSTGRES_POOL_TIMEOUT_SECONDS = 10.0
POSTGRES_POOL_RECYCLE_SECONDS = 1800
# A new PostgreSQL connection's limit (DATABASE_CONNECT_TIMEOUT_SECONDS): asyncpg's own default
# (60 s) outlasts any caller's patience.
POSTGRES_CONNECT_TIMEOUT_SECONDS = 10.0
PING_IDLE_SECONDS = 1.0  # a pooled PostgreSQL connection idle this long is pinged at checkout
_IDLE_SINCE = "rollout_idle_since"  # a pooled connection's record.info key: when it was checked in
READ_ONLY_OPTION = "rollout_read_only"
CHECK_TIMEOUT_SECONDS = 5.0  # a readiness check's wait for the database
# Ids per `IN (...)` list: far below the bound-parameter limits of SQLite (32766) and asyncpg (32767).
IN_LIST_CHUNK = 1000


def starts_with(column: ColumnExpressionArgument[str], prefix: str) -> ColumnElement[bool]:
    """`column` starts with `prefix`, compared exactly: SQLite's LIKE ignores ASCII case, and
    PostgreSQL's needs escaping; a substring equals the prefix on both, byte for byte."""
    return func.substr(column, 1, len(prefix)) == prefix


def utcnow() -> datetime:
    return datetime.now(UTC)


# The schemes people type, mapped to the async drivers the service installs (asyncpg, aiosqlite).
ASYNC_SCHEMES = {
    "postgresql": "postgresql+asyncpg",
    "postgres": "postgresql+asyncpg",
    "postgresql+psycopg": "postgresql+asyncpg",
    "postgresql+psycopg2": "postgresql+asyncpg",
    "sqlite": "sqlite+aiosqlite",
}
SUPPORTED_SCHEMES = ("postgresql+asyncpg", "sqlite+aiosqlite")


def async_url(url: str) -> str:
    """`url` with the service's async driver: `postgresql://` (the form most people type) becomes
    `postgresql+asyncpg://`, `sqlite://` `sqlite+aiosqlite://`. Raises ValueError, saying what to
    write, for a database the service does not speak."""
    scheme, separator, rest = url.partition("://")
    if not separator:
        raise ValueError(f"{url!r} is not a URL: write postgresql://user@host/db or sqlite:///path.db")
    scheme = ASYNC_SCHEMES.get(scheme.lower(), scheme.lower())
    if scheme not in SUPPORTED_SCHEMES:
        raise ValueError(
            f"the service stores into PostgreSQL or SQLite, not {url.partition('://')[0]!r}: write "
            "postgresql://user@host/db or sqlite:///path.db"
        )
    return f"{scheme}://{rest}"


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def unique_statement_name() -> str:
    """A prepared statement's name no other connection uses: behind a transaction-mode pooler
    (PgBouncer) a server connection outlives the client's, with the statements it prepared."""
    return f"__asyncpg_{uuid.uuid4().hex}__"


# asyncpg keeps no prepared statement across transactions (a transaction-mode pooler hands the next
# one to another server connection), and names each one uniquely.
TRANSACTION_POOLER_CONNECT_ARGS: dict[str, Any] = {
    "statement_cache_size": 0,
    "prepared_statement_cache_size": 0,
    "prepared_statement_name_func": unique_statement_name,
}


# orjson hands what it does not write as plain JSON (a subclass of str, int, dict or list, a
# dataclass, a datetime) to its `default`: none is given, so it refuses them, and json.dumps decides.
_ORJSON_OPTIONS = (
    orjson.OPT_PASSTHROUGH_SUBCLASS | orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME
)


def json_text(value: Any) -> str:
    """The text a JSON column stores: orjson's where it writes what json.dumps would mean, json.dumps's
    elsewhere, so what stored or failed before stores or fails the same: where orjson refuses the
    value (a lone surrogate, which json.dumps writes as its \\ud800 escape; an int past 64 bits; a
    key that is no str; a type of its own), and where it holds a NaN or an infinity, which orjson
    writes as null and json.dumps as NaN (SQLite stores it, PostgreSQL refuses it). Hand-picked for
    a measured hot path: json.dumps of a finished episode's messages, turns and info was 2-3% of the
    event loop at 2,000 episodes in flight; orjson writes them in a tenth of the time (65 against
    5 us for a 12-message transcript). Its text differs in form only (no spaces, UTF-8 where
    json.dumps writes \\u escapes): readers parse it."""
    try:
        text = orjson.dumps(value, option=_ORJSON_OPTIONS)
    except orjson.JSONEncodeError:
        return json.dumps(value)
    if b"null" in text and not all_finite(value):  # only a null may have been a NaN
        return json.dumps(value)
    return text.decode()


def make_engine(
    url: str,
    *,
    pool_size: int = POSTGRES_POOL_SIZE,
    max_overflow: int = POSTGRES_MAX_OVERFLOW,
    pool_timeout: float = POSTGRES_POOL_TIMEOUT_SECONDS,
    connect_timeout: float = POSTGRES_CONNECT_TIMEOUT_SECONDS,
    transaction_pooler: bool = False,
    echo: bool = False,
) -> AsyncEngine:
    """An async engine for a sqlite+aiosqlite:// or postgresql+asyncpg:// URL.

    SQLite: WAL, busy_timeout and foreign keys on every connection, and every transaction starts
    with BEGIN IMMEDIATE. SQLite has a single writer; a deferred transaction that reads and then
    writes fails at once with SQLITE_BUSY (a stale WAL snapshot) when another connection committed
    in between, whereas BEGIN IMMEDIATE waits up to busy_timeout for the write lock. So claimers in
    one process or many never see the same queued row. The pool sizes apply to PostgreSQL only.
    """
    if is_sqlite(url):
        engine = create_async_engine(url, echo=echo, module=one_trip_dbapi(), json_serializer=json_text)
        # Our driver runs an UPDATE or DELETE ... RETURNING for many parameter sets, and keeps how
        # many rows each returned (sqlite_driver.py): the writer batches such writes.
        engine.dialect.update_executemany_returning = True
        engine.dialect.delete_executemany_returning = True
        _make_sqlite_transactional(engine, foreign_keys=True)
        return engine
    engine = create_async_engine(
        url,
        echo=echo,
        pool_size=pool_size,
        max_overflow=max_overflow,
        pool_timeout=pool_timeout,
        pool_recycle=POSTGRES_POOL_RECYCLE_SECONDS,
        json_serializer=json_text,
        connect_args={
            "timeout": connect_timeout,
            **(TRANSACTION_POOLER_CONNECT_ARGS if transaction_pooler else {}),
        },
    )
    _ping_idle_connections(engine)
    return engine


def _ping_idle_connections(engine: AsyncEngine) -> None:
    """pool_pre_ping, for the connections that sat idle in the pool PING_IDLE_SECONDS or more.

    SQLAlchemy's pre-ping on asyncpg is three round trips (a transaction around `;`, for
    transaction-mode poolers) at every checkout: 7-9% of the event loop at 2,000 episodes in flight,
    where every reader, the writer's groups and the loops check out a connection many times a second.
    A connection used within the last second is not pinged: if the database went away since, the
    statement fails as a disconnect, the pool is invalidated, and the caller's retry (every write
    and loop is retried on transient errors) gets a new connection, as for a connection lost mid-
    transaction. A failed ping invalidates the pool as pre-ping does."""
    dialect = engine.sync_engine.dialect

    def checkin(dbapi_connection: Any, record: Any) -> None:
        record.info[_IDLE_SINCE] = time.monotonic()

    def checkout(dbapi_connection: Any, record: Any, proxy: Any) -> None:
        idle_since = record.info.get(_IDLE_SINCE)  # None: a new connection, not pinged (as pre-ping)
        if idle_since is None or time.monotonic() - idle_since < PING_IDLE_SECONDS:
            return
        try:
            dialect.do_ping(dbapi_connection)
        except dialect.loaded_dbapi.Error as error:
            if dialect.is_disconnect(error, dbapi_connection, None):
                raise InvalidatePoolError(f"pre-ping failed: {error}") from error
            raise

    event.listen(engine.sync_engine, "checkin", checkin)
    event.listen(engine.sync_engine, "checkout", checkout)


def make_migration_engine(url: str) -> AsyncEngine:
    """The engine Alembic migrates with: no pool; on SQLite transactional DDL and foreign keys OFF.

    Batch mode alters a SQLite table by copying it and dropping the original; with foreign keys on,
    dropping a referenced table would cascade-delete the rows referencing it. SQLite ignores
    `PRAGMA foreign_keys` inside a transaction, so it is left off for the whole connection.
    PostgreSQL: a few statements, none worth a cache, so it works through a transaction-mode pooler
    as it does directly.
    """
    if is_sqlite(url):
        engine = create_async_engine(url, poolclass=NullPool)
        _make_sqlite_transactional(engine, foreign_keys=False)
        return engine
    return create_async_engine(url, poolclass=NullPool, connect_args=TRANSACTION_POOLER_CONNECT_ARGS)


def _make_sqlite_transactional(engine: AsyncEngine, *, foreign_keys: bool) -> None:
    def on_connect(dbapi_connection: Any, connection_record: Any) -> None:
        # Stop the driver from issuing its own deferred BEGIN (and from running DDL outside any
        # transaction); begin_immediate issues ours.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
            cursor.execute(f"PRAGMA foreign_keys={'ON' if foreign_keys else 'OFF'}")
        finally:
            cursor.close()

    def begin_immediate(connection: Connection) -> None:
        # Read-only sessions (Database.reader) begin deferred: they read a WAL snapshot without
        # taking the single write lock, so a trainer pulling a large batch never holds up the
        # heartbeats and result writes.
        read_only = connection.get_execution_options().get(READ_ONLY_OPTION, False)
        begin = "BEGIN" if read_only else "BEGIN IMMEDIATE"
        driver = connection.connection.dbapi_connection
        if isinstance(driver, OneTripConnection):  # sent with the first statement, in its trip
            driver.begin_with_next_statement(begin)
        else:
            connection.exec_driver_sql(begin)

    def interrupt(dbapi_connection: Any, connection_record: Any, exception: BaseException | None) -> None:
        # A connection is invalidated when a statement's caller was cancelled mid-statement (a
        # client gone, an episode cancelled). aiosqlite runs the statement in its own thread, and
        # SQLAlchemy's close of the connection waits behind it: the write lock would be held, and
        # the canceller kept waiting, until the statement ends by itself. sqlite3's interrupt()
        # (thread-safe, and aiosqlite's own interrupt() calls it directly) ends it now.
        raw = getattr(dbapi_connection, "driver_connection", None)
        sqlite = getattr(raw, "_connection", None)  # aiosqlite's sqlite3 connection; None once closed
        if sqlite is not None:
            sqlite.interrupt()

    event.listen(engine.sync_engine, "connect", on_connect)
    event.listen(engine.sync_engine, "begin", begin_immediate)
    event.listen(engine.sync_engine, "invalidate", interrupt)


def make_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    # expire_on_commit=False: objects stay readable after commit without a lazy (sync) reload.
    return async_sessionmaker(engine, expire_on_commit=False)


class DatabaseStatus:
    """What this process last saw of its database: liveness reads it from memory, never waiting
    on a connection; the worker's own queries and readiness checks keep it current."""

    def __init__(self) -> None:
        self.seen = False
        self.error: str | None = None
        self.failed_at: float | None = None  # time.monotonic() of the last failure seen

    def ok(self) -> None:
        self.seen, self.error = True, None

    def failed(self, error: BaseException) -> None:
        self.seen, self.error = True, f"{type(error).__name__}: {error}"[:300]
        self.failed_at = time.monotonic()

    def answered_for(self, seconds: float) -> bool:
        """No failure seen in the last `seconds`."""
        return self.failed_at is None or time.monotonic() - self.failed_at >= seconds

    def describe(self) -> str:
        if not self.seen:
            return "unknown"
        return "ok" if self.error is None else f"error: {self.error}"


@dataclass(frozen=True)
class Database:
    """An engine and its session makers, e.g. for the app's lifespan: `Database.open(url)`, then
    `await database.dispose()`. `reader` is for sessions that only read (on SQLite they do not
    take the write lock); the service's writes go through `writer`."""

    url: str
    engine: AsyncEngine
    sessionmaker: async_sessionmaker[AsyncSession]
    reader: async_sessionmaker[AsyncSession]
    writer: Writer  # the process's writes, on one connection, committed in groups
    read_only: AsyncEngine  # the readers' engine: Core reads on the hot path skip the ORM session
    # One-statement reads that loops and long-polls repeat many times a second (is anything queued,
    # which batches were cancelled, is a batch done): on PostgreSQL each runs on its own (AUTOCOMMIT),
    # without the BEGIN and ROLLBACK round trips around it, as in a transaction it would see nothing
    # more (3-4% of the event loop at 2,000 episodes in flight). A transaction-mode pooler keeps them
    # in one (see batch_rows._without_snapshot); SQLite's are read_only's.
    single_reads: AsyncEngine
    status: DatabaseStatus = field(default_factory=DatabaseStatus, compare=False)
    # Behind a transaction-mode pooler (PgBouncer): a statement outside a transaction may be
    # prepared on one server connection and executed on another.
    transaction_pooler: bool = False

    @classmethod
    def open(
        cls,
        url: str,
        *,
        pool_size: int = POSTGRES_POOL_SIZE,
        max_overflow: int = POSTGRES_MAX_OVERFLOW,
        pool_timeout: float = POSTGRES_POOL_TIMEOUT_SECONDS,
        connect_timeout: float = POSTGRES_CONNECT_TIMEOUT_SECONDS,
        transaction_pooler: bool = False,
    ) -> Database:
        """The pool (PostgreSQL) serves the readers; the writer holds one connection of it at a time."""
        engine = make_engine(
            url,
            pool_size=pool_size,
            max_overflow=max_overflow,
            pool_timeout=pool_timeout,
            connect_timeout=connect_timeout,
            transaction_pooler=transaction_pooler,
        )
        read_only = engine.execution_options(**{READ_ONLY_OPTION: True})
        sessionmaker = make_sessionmaker(engine)
        single_reads = read_only
        if not is_sqlite(url) and not transaction_pooler:
            single_reads = read_only.execution_options(isolation_level="AUTOCOMMIT")
        return cls(
            url=url,
            engine=engine,
            sessionmaker=sessionmaker,
            reader=make_sessionmaker(read_only),
            writer=Writer(sessionmaker),
            read_only=read_only,
            single_reads=single_reads,
            transaction_pooler=transaction_pooler,
        )

    async def check(self, timeout_seconds: float = CHECK_TIMEOUT_SECONDS) -> str:
        """Asks the database (SELECT 1) and records the answer in `status`; returns it described."""
        try:
            async with asyncio.timeout(timeout_seconds):
                async with self.reader() as session:
                    await session.execute(text("SELECT 1"))
        except TimeoutError:
            self.status.failed(TimeoutError(f"no answer within {timeout_seconds:g} s"))
        except Exception as error:  # any failure to reach the database is the answer, not a crash
            self.status.failed(error)
        else:
            self.status.ok()
        return self.status.describe()

    async def dispose(self) -> None:
        await self.writer.aclose()
        await self.engine.dispose()


def alembic_config(url: str) -> Config:
    """The project's Alembic config, pointed at `url` (overriding Settings().database_url)."""
    if not MIGRATIONS_DIR.is_dir():
        # The migrations live next to the package in the source tree, not inside it.
        raise FileNotFoundError(f"no Alembic migrations at {MIGRATIONS_DIR}: run from a source checkout")
    config = Config(str(ALEMBIC_INI)) if ALEMBIC_INI.exists() else Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # '%' is ConfigParser interpolation syntax; URLs may contain it (escaped passwords).
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    # Leave the application's logging alone when migrating programmatically.
    config.attributes["configure_logger"] = False
    return config


def run_migrations(url: str, revision: str = "head") -> None:
    """Upgrade the database at `url` to `revision`. Synchronous: call it with no running event loop
    (from the CLI, or via asyncio.to_thread from async code)."""
    command.upgrade(alembic_config(url), revision)


class SchemaOutOfDate(RuntimeError):
    """The database is not at the newest migration; `python -m service migrate` fixes it."""


SCHEMA_POLL_SECONDS = 2.0


def wait_for_schema(url: str, timeout_seconds: float) -> int:
    """`migrate --check`: 0 once the database is at the newest migration (asked every
    SCHEMA_POLL_SECONDS until `timeout_seconds`), else 2 with the reason on stderr. An unreachable
    database counts as not yet migrated."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        try:
            check_schema(url)
            return 0
        except Exception as error:  # out of date, or no answer yet: both are waited on
            if time.monotonic() >= deadline:
                print(f"error: {error}", file=sys.stderr)
                return 2
        time.sleep(SCHEMA_POLL_SECONDS)


def head_revision(url: str) -> str | None:
    """The newest migration the service has."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config(url)).get_current_head()


def current_revision(url: str) -> str | None:
    """The migration the database at `url` is at (None: not migrated at all). Synchronous."""
    from alembic.runtime.migration import MigrationContext

    async def current() -> str | None:
        engine = make_migration_engine(url)
        try:
            async with engine.connect() as connection:
                return await connection.run_sync(
                    lambda sync: MigrationContext.configure(sync).get_current_revision()
                )
        finally:
            await engine.dispose()

    return asyncio.run(current())


def check_schema(url: str) -> None:
    """Raises SchemaOutOfDate unless the database at `url` is at the newest migration."""
    head = head_revision(url)
    revision = current_revision(url)
    if revision != head:
        raise SchemaOutOfDate(
            f"the database is at migration {revision or 'none'}, the service needs {head}: "
            "run `python -m service migrate` first"
        )
