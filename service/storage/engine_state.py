"""What the service's processes share about the engine, in engine_state's one row: the newest weight
version any process sampled from, and a pause (POST /engine/pause) not continued yet. A process's
own view would make `max_staleness` a bound per process and a pause visible only to the process a
trainer happened to call (`serve --workers N`, several replicas on one database)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import case, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from service.storage.db import Database, utcnow
from service.storage.models import EngineState
from service.storage.writer import Transactions

_ROW = EngineState.id == 1
_NEWEST = EngineState.newest_weight_version


@dataclass(frozen=True)
class Pause:
    since: datetime
    by: str  # the worker id of the process that paused
    mode: str


async def raise_newest_version(writes: Transactions, seen: int) -> int | None:
    """Raises the shared newest weight version to `seen` if that is newer; returns the shared one."""
    raised = case((_NEWEST.is_(None) | (_NEWEST < seen), seen), else_=_NEWEST)
    async with writes.begin() as session:
        return await session.scalar(
            update(EngineState).where(_ROW).values({_NEWEST: raised}).returning(_NEWEST)
        )


_READ_NEWEST = select(_NEWEST).where(_ROW)


async def read_newest_version(database: Database) -> int | None:
    """The shared newest version: a statement built once, on a Core connection (each worker asks
    every second while its episodes run)."""
    async with database.single_reads.connect() as connection:
        return (await connection.execute(_READ_NEWEST)).scalar()


async def record_pause(writes: Transactions, by: str, mode: str) -> None:
    async with writes.begin() as session:
        await session.execute(
            update(EngineState).where(_ROW).values(paused_at=utcnow(), paused_by=by, pause_mode=mode)
        )


async def clear_pause(writes: Transactions) -> None:
    async with writes.begin() as session:
        await session.execute(
            update(EngineState).where(_ROW).values(paused_at=None, paused_by=None, pause_mode=None)
        )


async def read_pause(database: Database) -> Pause | None:
    async with database.reader() as session:
        return await _pause(session)


async def _pause(session: AsyncSession) -> Pause | None:
    row = (
        await session.execute(
            select(EngineState.paused_at, EngineState.paused_by, EngineState.pause_mode).where(_ROW)
        )
    ).one_or_none()
    if row is None or row.paused_at is None:
        return None
    return Pause(since=row.paused_at, by=row.paused_by or "", mode=row.pause_mode or "")
