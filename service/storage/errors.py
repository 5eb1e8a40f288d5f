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
# SQLAlchemy raises asyncpg's own refusals as a plain DBAPIError (NaN in a json value: asyncpg's
# DataError): they are found on its `orig`'s cause, by their SQLSTATE class (data, integrity,
# syntax or access rule).
_REFUSED = (DataError, IntegrityError, ProgrammingError)
_REFUSED_BY_ASYNCPG = (
    asyncpg.exceptions.DataError,
    asyncpg.exceptions.IntegrityConstraintViolationError,
    asyncpg.exceptions.SyntaxOrAccessError,
)
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
    if is_transient(error):
        return False
    if isinstance(error, _REFUSED):
        return True
    return any(isinstance(cause, _REFUSED_BY_ASYNCPG) for cause in _causes(error))


def _causes(error: BaseException) -> list[BaseException]:
    """The error and what caused it, down to the driver's own (SQLAlchemy keeps it on `orig`)."""
    chain: list[BaseException] = []
    seen: BaseException | None = error
    while seen is not None and len(chain) < _CHAIN_LIMIT:
        chain.append(seen)
        seen = getattr(seen, "orig", None) or seen.__cause__ or seen.__context__
    return chain


def startup_problem(url: str, error: BaseException) -> str:
    """What a failure to open the database at `url` at start-up means, in one line that says what
    to do: the command line prints it instead of a traceback."""
    from sqlalchemy.engine import make_url

    try:
        parsed = make_url(url)
    except Exception:  # the URL itself is the problem; its text says how
        return f"DATABASE_URL {url!r} is not a database URL: {error}"
    host = parsed.host or "localhost"
    where = f"{host}:{parsed.port or 5432}"
    refused = (
        asyncpg.exceptions.InvalidAuthorizationSpecificationError,
        asyncpg.exceptions.InvalidPasswordError,
    )
    for cause in _causes(error):
        if isinstance(cause, asyncpg.exceptions.InvalidCatalogNameError):
            return (
                f"the database {parsed.database!r} does not exist on {where}: create it "
                f"(createdb -h {host} {parsed.database}), then run `python -m service migrate`"
            )
        if isinstance(cause, refused):
            return (
                f"PostgreSQL at {where} refused user {parsed.username!r}: {cause} "
                "(check DATABASE_URL's user and password)"
            )
        if isinstance(cause, OSError) and parsed.get_backend_name() == "postgresql":
            return (
                f"cannot reach PostgreSQL at {where} ({cause}): is it running, is DATABASE_URL's host right?"
            )
    root = _causes(error)[-1]
    if parsed.get_backend_name() == "sqlite":
        return sqlite_problem(parsed.database) or f"cannot open the SQLite file {parsed.database!r}: {root}"
    first_line = (str(error).splitlines() or [""])[0]
    shown = parsed.render_as_string(hide_password=True)
    return f"cannot use the database {shown}: {type(error).__name__}: {first_line}"


def sqlite_problem(path: str | None) -> str | None:
    """Why a SQLite database file at `path` cannot be opened, checked before any driver tries (the
    driver's own failure leaves a thread that prints a traceback at exit); None if nothing is wrong."""
    import os
    from pathlib import Path

    if not path or path == ":memory:" or path.startswith("file:"):
        return None
    directory = Path(path).expanduser().absolute().parent
    if not directory.is_dir():
        return f"cannot open the SQLite database {path!r}: no directory {directory}: create it"
    if not os.access(directory, os.W_OK):
        return f"cannot open the SQLite database {path!r}: this user may not write in {directory}"
    return None
