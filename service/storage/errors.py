"""Which database errors are transient (an outage: retry, answer 503) and which are refused (the
statement or its data: no retry helps); everything else a database call raises is a bug. Storage
owns this policy: the worker, the group log and the API's error handlers ask it."""

from __future__ import annotations

import asyncpg
from sqlalchemy.exc import (
    DataError,
    DBAPIError,
    IntegrityError,
    InterfaceError,
    OperationalError,
    ProgrammingError,
    SQLAlchemyError,
)
from sqlalchemy.exc import TimeoutError as PoolTimeout

# What a database call may raise, whatever its cause: the classes the API's handlers catch to tell
# an outage (503) from a bug (500) by `is_transient`.
DATABASE_ERROR_TYPES: tuple[type[Exception], ...] = (
    SQLAlchemyError,
    OSError,
    asyncpg.PostgresError,
    asyncpg.InterfaceError,
)
# SQLAlchemy's pool timeout and connection errors; asyncpg's errors of a server that is down, going
# down, starting, out of connections, failing over (read-only), gone (the database dropped), or that
# asks for a retry (serialization, deadlock). SQLAlchemy wraps most of asyncpg's in a plain
# DBAPIError: they are found on its `orig`'s cause.
_TRANSIENT = (
    PoolTimeout,
    OSError,  # the socket under the driver: refused, reset, unreachable, timed out at connect
    OperationalError,  # SQLite: locked, unable to open the file; PostgreSQL: the connection failed
    InterfaceError,
    asyncpg.PostgresConnectionError,
    asyncpg.exceptions.OperatorInterventionError,
    asyncpg.exceptions.InsufficientResourcesError,
    asyncpg.exceptions.InvalidCatalogNameError,
    asyncpg.exceptions.ReadOnlySQLTransactionError,
    asyncpg.exceptions.TransactionRollbackError,
)
# The statement or the values it carries (e.g. a NUL character in a JSON text, a duplicate key).
_REFUSED = (DataError, IntegrityError, ProgrammingError)
_CHAIN_LIMIT = 8  # causes followed from the raised error to the driver's


def is_transient(error: BaseException) -> bool:
    """The database could not serve the call: its pool timed out, its connection failed (refused,
    reset, or invalidated), or the server refused it for a reason a retry may clear. SQLite's
    OperationalError (locked, unable to open the file) counts too. A refused statement or value
    (DataError, IntegrityError, ProgrammingError) does not, nor does anything else."""
    seen: BaseException | None = error
    for _ in range(_CHAIN_LIMIT):
        if seen is None:
            return False
        if isinstance(seen, _TRANSIENT):
            return True
        if isinstance(seen, DBAPIError):
            if seen.connection_invalidated:
                return True
            seen = seen.orig
            continue
        seen = seen.__cause__ or seen.__context__
    return False


def is_refused(error: BaseException) -> bool:
    """The database refused the statement or its data: the same call fails again however often it
    is retried (a ProgrammingError is a bug of ours, a DataError or IntegrityError may be the data's)."""
    return isinstance(error, _REFUSED) and not is_transient(error)
