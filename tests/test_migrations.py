from __future__ import annotations

import asyncio
from typing import Any

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Connection, inspect

from service.storage.db import alembic_config, make_engine, run_migrations
from service.storage.models import Base


def _schema_diff(connection: Connection) -> list[Any]:
    context = MigrationContext.configure(
        connection, opts={"compare_type": True, "compare_server_default": True}
    )
    return list(compare_metadata(context, Base.metadata))


def _table_names(connection: Connection) -> set[str]:
    return set(inspect(connection).get_table_names())


async def _inspect(url: str) -> tuple[list[Any], set[str]]:
    engine = make_engine(url)
    try:
        async with engine.connect() as connection:
            return await connection.run_sync(_schema_diff), await connection.run_sync(_table_names)
    finally:
        await engine.dispose()


async def test_head_matches_the_models_and_downgrades_to_nothing(empty_database_url: str) -> None:
    await asyncio.to_thread(run_migrations, empty_database_url)
    diff, tables = await _inspect(empty_database_url)
    assert diff == []
    assert tables == {"alembic_version", "batches", "episodes"}

    await asyncio.to_thread(command.downgrade, alembic_config(empty_database_url), "base")
    _, tables = await _inspect(empty_database_url)
    assert tables == {"alembic_version"}

    # And back up again: the downgrade left nothing behind that blocks a re-upgrade.
    await asyncio.to_thread(run_migrations, empty_database_url)
    diff, _ = await _inspect(empty_database_url)
    assert diff == []


async def test_migrated_fixture_database_is_at_head(database_url: str) -> None:
    diff, _ = await _inspect(database_url)
    assert diff == []
