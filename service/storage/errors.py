"""Which database errors mean "unreachable or overloaded, try again" rather than a bug."""

from __future__ import annotations

import asyncpg
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

# SQLAlchemy's pool timeout and connection errors; asyncpg's errors of a server that is down, going
# down, starting, out of connections, failing over (read-only), gone (the database dropped), or that
# asks for a retry (serialization, deadlock). SQLAlchemy wraps most of asyncpg's in a plain
# DBAPIError: they are found on its `orig`'s cause.
_UNAVAILABLE = (
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
_CHAIN_LIMIT = 8  # causes followed from the raised error to the driver's


def database_unavailable(error: BaseException) -> bool:
    """The database could not serve the call: its pool timed out, its connection failed (refused,
    reset, or invalidated), or the server refused it for a reason a retry may clear. SQLite's
    OperationalError (locked, unable to open the file) counts too. A refused statement or value
    (DataError, IntegrityError, ProgrammingError) does not."""
    seen: BaseException | None = error
    for _ in range(_CHAIN_LIMIT):
        if seen is None:
            return False
        if isinstance(seen, _UNAVAILABLE):
            return True
        if isinstance(seen, DBAPIError):
            if seen.connection_invalidated:
                return True
            seen = seen.orig
            continue
        seen = seen.__cause__ or seen.__context__
    return False
