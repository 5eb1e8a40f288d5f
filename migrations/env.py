"""Alembic environment: async engine, the models' metadata, batch mode (ALTER by copy) on SQLite.

The URL is the one set on the Alembic config (service.storage.db.alembic_config(url), used by
run_migrations and the tests), else Settings().database_url.
"""

from __future__ import annotations

import asyncio
from logging.config import fileConfig

from alembic import context
from sqlalchemy import Connection

from service.config import Settings
from service.storage.db import is_sqlite, make_migration_engine
from service.storage.models import Base

config = context.config
if config.config_file_name is not None and config.attributes.get("configure_logger", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def database_url() -> str:
    return config.get_main_option("sqlalchemy.url") or Settings().database_url


def configure(**kwargs: object) -> None:
    sqlite = is_sqlite(database_url())
    context.configure(
        target_metadata=target_metadata,
        render_as_batch=sqlite,
        # make_migration_engine makes SQLite DDL transactional, so a failed migration rolls back.
        transactional_ddl=True if sqlite else None,
        compare_type=True,
        **kwargs,  # type: ignore[arg-type]
    )


def run_migrations_offline() -> None:
    configure(url=database_url(), literal_binds=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def do_run_migrations(connection: Connection) -> None:
    configure(connection=connection)
    with context.begin_transaction():
        context.run_migrations()


async def run_async_migrations() -> None:
    engine = make_migration_engine(database_url())
    try:
        async with engine.connect() as connection:
            await connection.run_sync(do_run_migrations)
    finally:
        await engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    asyncio.run(run_async_migrations())
