"""The episode queue as seen by workers: claim, renew, finish, release, and the lease sweep.

Each function runs one short transaction of `sm` (the process's Writer, or a sessionmaker), since
jobs carry ids, not ORM objects. Ownership of a running episode is (lease_owner, attempt): a write
that does not match both changes nothing, which is what makes a result stored exactly once
although an episode whose worker lost its lease may run again elsewhere.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Row,
    String,
    Table,
    Update,
    bindparam,
    cast,
    delete,
    func,
    literal,
    select,
    update,
)
from sqlalchemy.ext.asyncio import AsyncSession

from service.records import EpisodeRequest, EpisodeResult, EpisodeSpec, EpisodeStatus
from service.storage import blobs
from service.storage.agents import EXTERNAL_OWNER
from service.storage.db import IN_LIST_CHUNK, Database, utcnow
from service.storage.models import REQUEST_COLUMNS, Batch, Episode, EpisodeSegment
from service.storage.writer import Transactions

_QUEUED = EpisodeStatus.QUEUED.value
_RUNNING = EpisodeStatus.RUNNING.value
# A re-queued episode runs again as a new attempt: attempt + 1 fences out the old lease holder. An
# agent-driven episode's attempt (storage/driven.py) loses its token, the calls its driver made and
# its closed segments (_drop_segments): the new attempt's driver starts afresh, and the old token
# can neither call nor finish (it is kept as dead_agent_token, to tell its holder why).
_REQUEUED: dict[str, Any] = {
    "status": _QUEUED,
    "attempt": Episode.attempt + 1,
    "lease_owner": None,
    "lease_expires_at": None,
    "started_at": None,
    "agent_token": None,
    "dead_agent_token": func.coalesce(Episode.agent_token, Episode.dead_agent_token),
    "num_turns": None,
    "segments": 1,
    **dict.fromkeys(blobs.TOKEN_BLOBS),
    "turns": None,
    "messages": None,
}


@dataclass(frozen=True)
class ClaimedEpisode:
    """An episode leased to a worker: what to run, and where the episode sits in its batch.
    `spec.attempt` is the lease's fencing token: finish_episode needs it back."""

    spec: EpisodeSpec
    batch_id: str
    group_index: int
    sample_index: int
    failures: int  # failed attempts before this one

    @property
    def id(self) -> str:
        return self.spec.episode_id

    @property
    def attempt(self) -> int:
        return self.spec.attempt


def _result_columns(result: EpisodeResult) -> dict[str, Any]:
    tokens: dict[str, bytes | None] = dict.fromkeys(blobs.TOKEN_BLOBS)
    if result.tokens is not None:
        tokens |= blobs.encode_tokens(result.tokens)
    return {
        "status": result.status.value,
        "reward": result.reward,
        **tokens,
        "messages": result.messages,
        "info": result.info,
        "turns": [turn.to_json() for turn in result.turns],
        "error": result.error,
        "num_turns": result.num_turns,
    }


def _chunks(ids: Sequence[str]) -> Iterator[Sequence[str]]:
    for start in range(0, len(ids), IN_LIST_CHUNK):
        yield ids[start : start + IN_LIST_CHUNK]


_CLAIM_HEAD = (
    Episode.id,
    Episode.attempt,
    Episode.failures,
    Episode.batch_id,
    Episode.group_index,
    Episode.sample_index,
)
# A claim's row closes with the request's columns, taken by position: read by name through the row's
# `_mapping` (a new mapping per column), they were 5.3% of the service's CPU per call of agent-driven
# episodes, by position 0.3% (py-spy, bench/verifiers_envs.py).
_CLAIMED_COLUMNS = (*_CLAIM_HEAD, *REQUEST_COLUMNS)
_REQUEST_NAMES = tuple(column.name for column in REQUEST_COLUMNS)
_REQUEST_AT = len(_CLAIM_HEAD)


def _claimed(row: Row[Any]) -> ClaimedEpisode:
    request = EpisodeRequest(**dict(zip(_REQUEST_NAMES, row[_REQUEST_AT:], strict=True)))
    return ClaimedEpisode(
        spec=EpisodeSpec(row.id, row.attempt, request),
        batch_id=row.batch_id,
        group_index=row.group_index,
        sample_index=row.sample_index,
        failures=row.failures,
    )


_ANY_QUEUED = select(Episode.id).where(Episode.status == _QUEUED).limit(1)


async def any_queued(database: Database) -> bool:
    """Whether an episode waits in the queue: one read of the status index on a reader's
    connection. The claim loop asks before it claims: a claim joins the writer's group (on SQLite
    the file's write lock) even when it finds nothing, five times a second per idle process."""
    async with database.single_reads.connect() as connection:
        return (await connection.execute(_ANY_QUEUED)).first() is not None


async def claim_episodes(
    sm: Transactions, worker_id: str, limit: int, lease_seconds: float, *, now: datetime | None = None
) -> list[ClaimedEpisode]:
    """Lease up to `limit` queued episodes to `worker_id`, oldest first, groups in order.

    PostgreSQL: the row locks of FOR UPDATE SKIP LOCKED make concurrent claimers pick disjoint
    rows. SQLite ignores FOR UPDATE, but its transactions begin IMMEDIATE (see make_engine), so
    claimers are serialized. Select and update are two statements on purpose: PostgreSQL may
    re-run an `IN (SELECT ... LIMIT n FOR UPDATE SKIP LOCKED)` subquery and update more than n rows.
    """
    if limit <= 0:
        return []
    now = now or utcnow()
    async with sm.begin() as session:
        ids = list(
            await session.scalars(
                select(Episode.id)
                .where(Episode.status == _QUEUED)
                .order_by(Episode.created_at, Episode.batch_id, Episode.group_index, Episode.sample_index)
                .limit(limit)
                .with_for_update(skip_locked=True)
            )
        )
        if not ids:
            return []
        rows = await session.execute(
            update(Episode)
            .where(Episode.id.in_(ids), Episode.status == _QUEUED)
            .values(
                status=_RUNNING,
                lease_owner=worker_id,
                lease_expires_at=now + timedelta(seconds=lease_seconds),
                started_at=now,
            )
            .returning(*_CLAIMED_COLUMNS)
            .execution_options(synchronize_session=False)
        )
        claimed = {row.id: _claimed(row) for row in rows}
    return [claimed[episode_id] for episode_id in ids if episode_id in claimed]


async def renew_leases(
    sm: Transactions,
    worker_id: str,
    episode_ids: Collection[str],
    lease_seconds: float,
    *,
    now: datetime | None = None,
) -> set[str]:
    """Extend the leases of the given episodes still running under `worker_id`; returns those ids.

    The caller should abandon every other id: it was re-queued (or finished) behind its back.
    """
    now = now or utcnow()
    renewed: set[str] = set()
    async with sm.begin() as session:
        for chunk in _chunks(sorted(episode_ids)):
            result = await session.scalars(
                update(Episode)
                .where(Episode.id.in_(chunk), Episode.lease_owner == worker_id, Episode.status == _RUNNING)
                .values(lease_expires_at=now + timedelta(seconds=lease_seconds))
                .returning(Episode.id)
                .execution_options(synchronize_session=False)
            )
            renewed.update(result)
    return renewed


async def requeue_expired(
    sm: Transactions, max_attempts: int, *, spare_owner: str | None = None, now: datetime | None = None
) -> int:
    """Re-queue running episodes whose lease expired (their worker crashed or was killed), with
    attempt + 1 and failures + 1; an episode at `max_attempts` failures fails instead. Returns how
    many episodes were re-queued or failed.

    `spare_owner`: a live worker's own episodes are left alone; its heartbeat may merely be late
    under load, and re-queuing them would throw their work away.
    """
    now = now or utcnow()
    expired: tuple[ColumnElement[bool], ...] = (
        Episode.status == _RUNNING,
        Episode.lease_expires_at < now,
        Episode.lease_owner != EXTERNAL_OWNER,  # waits for its agent: see storage/agents.py
    )
    if spare_owner is not None:
        expired = (*expired, Episode.lease_owner != spare_owner)
    used_up = Episode.failures + 1 >= max_attempts
    async with sm.begin() as session:
        failed = await session.scalars(
            update(Episode)
            .where(*expired, used_up)
            .values(
                status=EpisodeStatus.FAILED.value,
                error=literal(f"lease expired {max_attempts} times (a worker crashed or was killed); ")
                + literal("last attempt ")
                + cast(Episode.attempt, String),
                failures=Episode.failures + 1,
                lease_expires_at=None,
                finished_at=now,
            )
            .returning(Episode.id)
            .execution_options(synchronize_session=False)
        )
        requeued = await session.scalars(
            update(Episode)
            .where(*expired, ~used_up)
            .values(**_REQUEUED, failures=Episode.failures + 1)
            .returning(Episode.id)
            .execution_options(synchronize_session=False)
        )
        requeued_ids = list(requeued)
        await _drop_segments(session, requeued_ids)
        return len(failed.all()) + len(requeued_ids)


async def _drop_segments(session: AsyncSession, episode_ids: Sequence[str]) -> None:
    """Deletes the closed segments of re-queued episodes (an agent-driven one's dead attempt)."""
    for chunk in _chunks(sorted(episode_ids)):
        await session.execute(delete(EpisodeSegment).where(EpisodeSegment.episode_id.in_(chunk)))


async def finish_episode(
    sm: Transactions,
    worker_id: str,
    episode_id: str,
    attempt: int,
    result: EpisodeResult,
    *,
    now: datetime | None = None,
) -> bool:
    """Store the result if the episode is still running under (`worker_id`, `attempt`).

    Returns False, writing nothing, when the lease was lost (re-queued, failed or released).
    """
    params = _finish_params(worker_id, Finished(episode_id, attempt, result), now or utcnow())
    async with sm.begin() as session:
        stored = await session.execute(_FINISH, params)
        return stored.first() is not None


@dataclass(frozen=True)
class Finished:
    """A result to store under the lease it was run with: (episode_id, attempt) is its fence."""

    episode_id: str
    attempt: int
    result: EpisodeResult


async def finish_episodes(
    session: AsyncSession, worker_id: str, finished: Sequence[Finished], *, now: datetime | None = None
) -> list[bool]:
    """Store several results in the caller's transaction, each only if its episode still runs under
    (`worker_id`, its attempt): one fence read, which on PostgreSQL locks the rows it finds (FOR
    UPDATE) until the transaction ends, then one executemany of the rows it found. On SQLite the
    writer's transaction holds the file's write lock from its BEGIN IMMEDIATE, so no row changes in
    between there either. Returns, in order, whether each was stored; an (episode, attempt) given
    twice is stored once, as finish_episode would.
    """
    if not finished:
        return []
    now = now or utcnow()
    if len(finished) == 1:  # alone: one statement, fenced by its WHERE, costs less than two
        alone = await session.execute(_FINISH, _finish_params(worker_id, finished[0], now))
        return [alone.first() is not None]
    owned: set[tuple[str, int]] = set()
    for chunk in _chunks(sorted({item.episode_id for item in finished})):
        rows = await session.execute(_FENCE, {"owner": worker_id, "episodes": chunk})
        owned.update((row.id, row.attempt) for row in rows)
    stored: list[bool] = []
    rows_to_write: list[dict[str, Any]] = []
    for item in finished:
        fence = (item.episode_id, item.attempt)
        stored.append(fence in owned)
        if fence in owned:
            owned.discard(fence)  # given twice: the second finds it finished
            rows_to_write.append(_finish_params(worker_id, item, now))
    if rows_to_write:
        await session.execute(_FINISH_MANY, rows_to_write)
    return stored


def _finish_params(worker_id: str, item: Finished, now: datetime) -> dict[str, Any]:
    values = {f"result_{name}": value for name, value in _result_columns(item.result).items()}
    return values | {"episode": item.episode_id, "owner": worker_id, "fence": item.attempt, "now": now}


_EPISODES: Table = Episode.__table__  # type: ignore[assignment]  # a declarative model's Table


def _finish_statement() -> Update:
    """The result write, built once: one per finished episode is the queue's hottest statement."""
    table = _EPISODES
    columns = {name: table.c[name] for name in _result_columns(EpisodeResult.failed(""))}
    return (
        update(table)
        .where(
            table.c.id == bindparam("episode"),
            table.c.status == _RUNNING,
            table.c.lease_owner == bindparam("owner"),
            table.c.attempt == bindparam("fence"),
        )
        .values(
            {column: bindparam(f"result_{name}", type_=column.type) for name, column in columns.items()}
            | {
                table.c.lease_expires_at: None,
                table.c.finished_at: bindparam("now", type_=table.c.finished_at.type),
            }
        )
    )


_FINISH_MANY = _finish_statement()  # an executemany: the fence read before it found its rows
_FINISH = _FINISH_MANY.returning(_EPISODES.c.id)
# Rows locked in id order: two transactions locking some of the same rows cannot deadlock on them.
_FENCE = (
    select(Episode.id, Episode.attempt)
    .where(
        Episode.id.in_(bindparam("episodes", expanding=True)),
        Episode.status == _RUNNING,
        Episode.lease_owner == bindparam("owner"),
    )
    .order_by(Episode.id)
    .with_for_update()
)


async def release_episodes(
    sm: Transactions,
    worker_id: str,
    episode_ids: Collection[str] | None = None,
    *,
    failed: bool = False,
    attempt: int | None = None,
) -> int:
    """Put episodes still running under `worker_id` back in the queue (attempt + 1), e.g. on a
    graceful shutdown; None releases all of them. `failed`: the attempt failed (an unreachable
    engine) and counts towards max_attempts. Returns how many were released."""
    values = {**_REQUEUED, "failures": Episode.failures + 1} if failed else _REQUEUED
    released = 0
    owned: tuple[ColumnElement[bool], ...] = (Episode.lease_owner == worker_id, Episode.status == _RUNNING)
    if attempt is not None:  # only that attempt: a newer one of the same episode is not ours to release
        owned = (*owned, Episode.attempt == attempt)
    chunks: list[Sequence[str] | None] = [None] if episode_ids is None else list(_chunks(sorted(episode_ids)))
    async with sm.begin() as session:
        for chunk in chunks:
            statement = update(Episode).where(*owned)
            if chunk is not None:
                statement = statement.where(Episode.id.in_(chunk))
            result = await session.scalars(
                statement.values(**values).returning(Episode.id).execution_options(synchronize_session=False)
            )
            ids = list(result)
            await _drop_segments(session, ids)
            released += len(ids)
    return released


_CANCELLED = select(Batch.id).where(
    Batch.id.in_(bindparam("batches", expanding=True)), Batch.cancelled_at.is_not(None)
)


async def cancelled_batches(database: Database, batch_ids: Collection[str]) -> set[str]:
    """Those of `batch_ids` that were cancelled: a lookup by primary key per chunk of ids, a
    statement built once on a reader's connection (each worker asks twice a second: building the
    query and an ORM session each time was 2-4% of the service's CPU at 2,000 in flight)."""
    cancelled: set[str] = set()
    async with database.single_reads.connect() as connection:
        for chunk in _chunks(sorted(batch_ids)):
            cancelled.update((await connection.execute(_CANCELLED, {"batches": list(chunk)})).scalars())
    return cancelled
