"""Reads only tests make: a batch's rows and its episodes as ORM objects, the queue's depth. The
service reads batches through storage/batch_rows.py and storage/browse.py instead."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import defer

from service.records import EpisodeStatus
from service.storage.models import TOKEN_COLUMNS, Batch, Episode


async def get_batch(session: AsyncSession, batch_id: str) -> Batch | None:
    return await session.get(Batch, batch_id)


async def queue_depth(session: AsyncSession) -> int:
    """How many episodes wait to be claimed."""
    count = await session.scalar(
        select(func.count()).select_from(Episode).where(Episode.status == EpisodeStatus.QUEUED.value)
    )
    return int(count or 0)


async def load_batch_episodes(
    session: AsyncSession, batch_id: str, *, with_tokens: bool = True
) -> list[Episode]:
    """The batch's episodes ordered by (group_index, sample_index).

    with_tokens=False leaves out the token blobs; touching one of them then raises instead of
    loading it.
    """
    statement = (
        select(Episode)
        .where(Episode.batch_id == batch_id)
        .order_by(Episode.group_index, Episode.sample_index)
    )
    if not with_tokens:
        statement = statement.options(*(defer(column, raiseload=True) for column in TOKEN_COLUMNS))
    return list(await session.scalars(statement))
