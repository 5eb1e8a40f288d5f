"""Reads for people looking at runs (GET /batches, the viewer): batches newest first, a page at a
time, and a batch's episodes whatever their status. The trainer's reads are in batch_rows.py."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Row, and_, func, or_, select

from service.records import EpisodeStatus
from service.storage.batch_rows import BATCH_SELECTED, SUMMARY_SELECTED
from service.storage.db import Database, starts_with
from service.storage.models import Batch, Episode


@dataclass(frozen=True)
class BatchListing:
    """One batch as the list shows it: where its episodes stand and what they earned so far."""

    batch: dict[str, Any]  # BATCH_SELECTED, by label
    counts: dict[str, int]  # every status a key
    reward_mean: float | None  # over its episodes that have a reward; None: none has yet


@dataclass(frozen=True)
class BatchListPage:
    batches: list[BatchListing]
    next: str | None  # the last batch's id, to pass as `before` for the next page; None: no more


class UnknownCursor(LookupError):
    pass


async def list_batches(
    database: Database, *, limit: int, before: str | None = None, prefix: str = ""
) -> BatchListPage:
    """Batches newest first (created_at, then id, descending), `limit` of them, older than the batch
    `before` names when given (keyset paging: a page does not shift as new batches arrive), those
    whose id starts with `prefix` only. Raises UnknownCursor when `before` names no batch."""
    statement = select(*BATCH_SELECTED).order_by(Batch.created_at.desc(), Batch.id.desc()).limit(limit + 1)
    if prefix:
        statement = statement.where(starts_with(Batch.id, prefix))
    async with database.reader() as session:
        if before is not None:
            cursor = await session.get(Batch, before)
            if cursor is None:
                raise UnknownCursor(before)
            statement = statement.where(
                or_(
                    Batch.created_at < cursor.created_at,
                    and_(Batch.created_at == cursor.created_at, Batch.id < cursor.id),
                )
            )
        found = list(await session.execute(statement))
        more = len(found) > limit
        batches = [row._asdict() for row in found[:limit]]
        ids = [batch["batch_id"] for batch in batches]
        rows = await session.execute(
            select(
                Episode.batch_id,
                Episode.status,
                func.count(),
                func.count(Episode.reward),
                func.sum(Episode.reward),
            )
            .where(Episode.batch_id.in_(ids))
            .group_by(Episode.batch_id, Episode.status)
        )
    counts = {batch_id: {status.value: 0 for status in EpisodeStatus} for batch_id in ids}
    rewarded: dict[str, tuple[int, float]] = {}
    for batch_id, status, count, with_reward, reward_sum in rows:
        counts[batch_id][status] = count
        seen, total = rewarded.get(batch_id, (0, 0.0))
        rewarded[batch_id] = (seen + with_reward, total + float(reward_sum or 0.0))
    listings = []
    for batch_id, batch in zip(ids, batches, strict=True):
        seen, total = rewarded.get(batch_id, (0, 0.0))
        listings.append(BatchListing(batch, counts[batch_id], total / seen if seen else None))
    return BatchListPage(batches=listings, next=ids[-1] if more else None)


async def batch_episode_summaries(
    database: Database, batch_id: str, statuses: Sequence[str] = ()
) -> tuple[dict[str, Any], list[Row[Any]]] | None:
    """The batch (batch_rows.BATCH_SELECTED, by label) and the summaries (SUMMARY_SELECTED) of its
    episodes, of any status or of `statuses`, by group then sample; None when there is no such
    batch."""
    statement = (
        select(*SUMMARY_SELECTED)
        .where(Episode.batch_id == batch_id)
        .order_by(Episode.group_index, Episode.sample_index)
    )
    if statuses:
        statement = statement.where(Episode.status.in_(statuses))
    async with database.reader() as session:
        batch = (await session.execute(select(*BATCH_SELECTED).where(Batch.id == batch_id))).first()
        if batch is None:
            return None
        return batch._asdict(), list(await session.execute(statement))
