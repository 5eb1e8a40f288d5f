"""The stream of complete groups: which groups completed, in what order, with what rewards.

Every group of a batch has a row in `groups`, inserted with the batch. Once all its episodes have a
final status (however they got it: a result, a cancel, a last failed attempt), `log_complete`
gives it the next `seq` and its reward statistics. Readers page through the log by `seq`
(`read_page`): a cursor is the last `seq` a reader has seen.

A cursor must never skip a group: a reader that has seen seq 8 must not later find a 7 committed
behind it. So seqs are handed out under one lock held until the commit (PostgreSQL: a transaction
advisory lock; SQLite: its single writer, BEGIN IMMEDIATE), which makes seq order commit order in
every process. Completeness is checked under that lock as well, after the finishing write
committed: of two processes finishing a group's last two episodes at once, the later one to take
the lock sees both finished.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import asdict, dataclass, fields
from datetime import datetime
from typing import Any

from sqlalchemy import Table, bindparam, exists, func, insert, select, text, tuple_, update
from sqlalchemy.ext.asyncio import AsyncSession

from service.records import FINISHED_STATUSES, EpisodeStatus
from service.storage.db import IN_LIST_CHUNK, Database, starts_with, utcnow
from service.storage.models import Episode, Group

GroupKey = tuple[str, int]  # (batch id, group index)

# pg_advisory_xact_lock's key for handing out seqs: any constant no other code of ours takes.
SEQ_LOCK_KEY = 0x67726F757073  # "groups"
SWEEP_LIMIT = 1000  # unlogged groups one sweep checks at a time (the first after an upgrade: many)
SCAN_ROWS = 500  # groups a page reads at a time while skipping filtered ones
MAX_SCANNED = 20_000  # groups one page looks at, filtered ones included, before it answers


@contextlib.asynccontextmanager
async def log_transaction(database: Database) -> AsyncIterator[AsyncSession]:
    """The transaction `log_complete` runs in. PostgreSQL: one of its own, committed at once, since
    it holds the seq lock until its commit; in the writer's group it would wait behind row locks
    another process's log transaction may be waiting on. SQLite has one writer and no row locks:
    the writer's group."""
    if database.engine.dialect.name == "postgresql":
        async with database.sessionmaker.begin() as session:
            yield session
    else:
        async with database.writer.begin() as session:
            yield session


_UNFINISHED = tuple(status.value for status in EpisodeStatus if status.value not in FINISHED_STATUSES)


@dataclass(frozen=True)
class RewardStats:
    """Over a group's episodes that have a reward; all None when none has. `std` is the
    population's (ddof 0), and exactly 0.0 when the rewards are all equal."""

    count: int
    mean: float | None
    std: float | None
    min: float | None
    max: float | None

    @classmethod
    def of(cls, rewards: Sequence[float | None]) -> RewardStats:
        values = [reward for reward in rewards if reward is not None]
        if not values:
            return cls(0, None, None, None, None)
        return cls.from_sums(
            len(values), math.fsum(values), math.fsum(v * v for v in values), min(values), max(values)
        )

    @classmethod
    def from_sums(cls, count: int, total: float, squares: float, low: float, high: float) -> RewardStats:
        """From a count, sum, sum of squares, min and max (as a database aggregates them)."""
        if count == 0:
            return cls(0, None, None, None, None)
        mean = total / count
        # All equal: exactly 0, not the rounding residue of the sums (a filter tests std > 0).
        std = 0.0 if low == high else math.sqrt(max(0.0, squares / count - mean * mean))
        return cls(count, mean, std, low, high)

    @classmethod
    def stored(cls, group: Group) -> RewardStats:
        """A logged group's, from its columns (`reward_count` and so on: see `columns`)."""
        return cls(**{field.name: getattr(group, f"reward_{field.name}") for field in fields(cls)})

    def columns(self) -> dict[str, Any]:
        """The `groups` columns that store these statistics: each field prefixed `reward_`."""
        return {f"reward_{name}": value for name, value in asdict(self).items()}


def group_rows(
    batch_id: str, env: str, tasks: Sequence[tuple[int, int, int]], now: datetime
) -> list[dict[str, Any]]:
    """The `groups` rows of a new batch: (group index, task index, size) per group."""
    return [
        {
            "batch_id": batch_id,
            "group_index": group,
            "env": env,
            "task_index": task,
            "size": size,
            "created_at": now,
        }
        for group, task, size in tasks
    ]


async def insert_groups(session: AsyncSession, rows: list[dict[str, Any]]) -> None:
    if rows:
        await session.execute(insert(Group), rows)


@dataclass(frozen=True)
class CompletedGroup:
    key: GroupKey
    seq: int
    stats: RewardStats


# Built once: a statement's operators build SQLAlchemy objects that point at each other (an
# expression and its comparator), cyclic garbage freed only by a full collection, which TUNE_GC makes
# rare; built for every block of results stored, they grew the soak's RSS (docs/benchmarks.md).
_UNLOGGED_COMPLETE_GROUPS = select(Group.batch_id, Group.group_index).where(
    Group.seq.is_(None),
    ~exists().where(
        Episode.batch_id == Group.batch_id,
        Episode.group_index == Group.group_index,
        Episode.status.in_(_UNFINISHED),
    ),
)
_GROUP_KEY = tuple_(Group.batch_id, Group.group_index)
_EPISODE_GROUP_KEY = tuple_(Episode.batch_id, Episode.group_index)
_GROUP_REWARDS = select(Episode.batch_id, Episode.group_index, Episode.reward, Episode.finished_at)
_LAST_SEQ = select(func.max(Group.seq))


async def log_complete(
    session: AsyncSession, candidates: Collection[GroupKey] | None, *, now: datetime | None = None
) -> list[CompletedGroup]:
    """Logs the complete groups among `candidates` (None: among every unlogged group, SWEEP_LIMIT
    at a time) that are not logged yet, in the caller's write transaction, which must commit soon:
    on PostgreSQL it holds the seq lock until then. Returns them in seq order."""
    if session.get_bind().dialect.name == "postgresql":
        await session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": SEQ_LOCK_KEY})
    query = _UNLOGGED_COMPLETE_GROUPS
    keys: list[GroupKey] = []
    if candidates is None:
        keys = [(row.batch_id, row.group_index) for row in await session.execute(query.limit(SWEEP_LIMIT))]
    else:
        wanted = list(candidates)
        for start in range(0, len(wanted), IN_LIST_CHUNK):
            chunk = wanted[start : start + IN_LIST_CHUNK]
            rows = await session.execute(query.where(_GROUP_KEY.in_(chunk)))
            keys.extend((row.batch_id, row.group_index) for row in rows)
    if not keys:
        return []
    rewards: dict[GroupKey, list[float | None]] = {key: [] for key in keys}
    last_finished: dict[GroupKey, datetime | None] = {}
    for start in range(0, len(keys), IN_LIST_CHUNK // 8):  # about 8 episodes a group
        chunk = keys[start : start + IN_LIST_CHUNK // 8]
        rows = await session.execute(_GROUP_REWARDS.where(_EPISODE_GROUP_KEY.in_(chunk)))
        for row in rows:
            key = (row.batch_id, row.group_index)
            rewards[key].append(row.reward)
            finished = last_finished.get(key)
            if row.finished_at is not None and (finished is None or row.finished_at > finished):
                last_finished[key] = row.finished_at
    # In the order they completed, as far as this one lock holder can tell.
    keys.sort(key=lambda key: (last_finished.get(key) or now or utcnow(), key))
    base = (await session.scalar(_LAST_SEQ)) or 0
    completed = [
        CompletedGroup(key, base + offset, RewardStats.of(rewards[key])) for offset, key in enumerate(keys, 1)
    ]
    await session.execute(
        _LOG,
        [
            {
                "key_batch": group.key[0],
                "key_group": group.key[1],
                "seq": group.seq,
                "completed_at": now or utcnow(),
                **group.stats.columns(),
            }
            for group in completed
        ],
    )
    return completed


def _log_statement() -> Any:
    table: Table = Group.__table__  # type: ignore[assignment]  # a declarative model's Table
    names = ("seq", "completed_at", *RewardStats(0, None, None, None, None).columns())
    return (
        update(table)
        .where(table.c.batch_id == bindparam("key_batch"), table.c.group_index == bindparam("key_group"))
        .values({table.c[name]: bindparam(name, type_=table.c[name].type) for name in names})
    )


_LOG = _log_statement()


async def batch_group_keys(session: AsyncSession, batch_id: str) -> list[GroupKey]:
    """The batch's groups not logged yet (after a cancel: every one may be complete now)."""
    rows = await session.execute(
        select(Group.group_index).where(Group.batch_id == batch_id, Group.seq.is_(None))
    )
    return [(batch_id, group) for group in rows.scalars()]


@dataclass(frozen=True)
class GroupFilter:
    """Which complete groups a reader wants: of some batches, of one env, with reward std above
    `min_reward_std` (None: every group; 0: those whose rewards are not all equal), of batches whose
    id starts with `batch_prefix` (a project key's scope: the others are not even counted)."""

    batch_ids: tuple[str, ...] | None = None
    batch_prefix: str = ""
    env: str | None = None
    min_reward_std: float | None = None

    def keeps(self, group: Group) -> bool:
        if self.min_reward_std is None:
            return True
        return group.reward_std is not None and group.reward_std > self.min_reward_std


@dataclass(frozen=True)
class GroupPage:
    groups: list[Group]  # in seq order
    next: int  # the cursor past every group this page looked at, kept or filtered
    filtered: int  # groups this page skipped for the filter's min_reward_std


async def read_page(session: AsyncSession, after: int, limit: int, where: GroupFilter) -> GroupPage:
    """Up to `limit` complete groups past the cursor `after` that `where` keeps, in seq order."""
    query = select(Group).where(Group.seq.is_not(None))
    if where.batch_ids is not None:
        query = query.where(Group.batch_id.in_(where.batch_ids))
    if where.env is not None:
        query = query.where(Group.env == where.env)
    if where.batch_prefix:
        query = query.where(starts_with(Group.batch_id, where.batch_prefix))
    kept: list[Group] = []
    cursor, filtered, scanned = after, 0, 0
    while len(kept) < limit and scanned < MAX_SCANNED:
        rows = list(
            await session.scalars(query.where(Group.seq > cursor).order_by(Group.seq).limit(SCAN_ROWS))
        )
        for group in rows:
            assert group.seq is not None
            cursor, scanned = group.seq, scanned + 1
            if where.keeps(group):
                kept.append(group)
                if len(kept) == limit:
                    break
            else:
                filtered += 1
        if len(rows) < SCAN_ROWS:
            break
    return GroupPage(kept, cursor, filtered)
