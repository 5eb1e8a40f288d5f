from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Connection, insert, inspect, select

from service.storage import groups
from service.storage.db import Database, alembic_config, make_engine, run_migrations
from service.storage.models import Base, Batch, Episode, Group
from tests.support.settings import CONNECT_TIMEOUT_SECONDS

NOW = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)


def _schema_diff(connection: Connection) -> list[Any]:
    context = MigrationContext.configure(
        connection, opts={"compare_type": True, "compare_server_default": True}
    )
    return list(compare_metadata(context, Base.metadata))


def _table_names(connection: Connection) -> set[str]:
    return set(inspect(connection).get_table_names())


async def _inspect(url: str) -> tuple[list[Any], set[str]]:
    engine = make_engine(url, connect_timeout=CONNECT_TIMEOUT_SECONDS)
    try:
        async with engine.connect() as connection:
            return await connection.run_sync(_schema_diff), await connection.run_sync(_table_names)
    finally:
        await engine.dispose()


async def test_head_matches_the_models_and_downgrades_to_nothing(empty_database_url: str) -> None:
    await asyncio.to_thread(run_migrations, empty_database_url)
    diff, tables = await _inspect(empty_database_url)
    assert diff == []
    assert tables == {"alembic_version", "batches", "episodes", "episode_segments", "groups", "engine_state"}

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


async def test_the_groups_of_earlier_batches_enter_the_stream(empty_database_url: str) -> None:
    """Batches stored before 0005 get their groups rows; the first sweep logs the complete ones."""
    url = empty_database_url
    await asyncio.to_thread(run_migrations, url, "0004")
    database = Database.open(url, connect_timeout=CONNECT_TIMEOUT_SECONDS)
    try:
        # The tables as 0004 left them: the models' (0005 adds a table and an index, no column).
        async with database.sessionmaker.begin() as session:
            await session.execute(
                insert(Batch),
                [{"id": "old", "request_hash": "h", "env": "builtin/shop", "task_split": "train",
                  "metadata_": {}, "created_at": NOW}],
            )  # fmt: skip
            await session.execute(
                insert(Episode),
                [
                    {
                        "id": f"e{group}{sample}",
                        "batch_id": "old",
                        "group_index": group,
                        "sample_index": sample,
                        "env": "builtin/shop",
                        "task_split": "train",
                        "task_index": 7 + group,
                        "sampling_params": {},
                        "max_turns": 5,
                        "status": status,
                        "attempt": 0,
                        "failures": 0,
                        "reward": reward,
                        "created_at": NOW,
                        "finished_at": None if minute is None else NOW.replace(minute=minute),
                    }
                    for group, sample, status, reward, minute in [
                        (0, 0, "completed", 1.0, 3),
                        (0, 1, "truncated", 0.0, 2),
                        (1, 0, "completed", 1.0, 1),
                        (1, 1, "running", None, None),
                        (2, 0, "failed", None, 1),
                    ]
                ],
            )
        await asyncio.to_thread(run_migrations, url)
        async with database.sessionmaker.begin() as session:
            logged = await groups.log_complete(session, None)
        assert [(group.key, group.seq) for group in logged] == [(("old", 2), 1), (("old", 0), 2)]
        assert logged[1].stats == groups.RewardStats(2, 0.5, 0.5, 0.0, 1.0)
        async with database.reader() as session:
            rows = {row.group_index: row for row in await session.scalars(select(Group))}
        assert {index: (row.task_index, row.size) for index, row in rows.items()} == {
            0: (7, 2),
            1: (8, 2),
            2: (9, 1),
        }
        assert rows[1].seq is None  # still running
    finally:
        await database.dispose()
