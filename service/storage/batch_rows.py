"""A batch as the trainer pulls it: the batch, its counts and the episodes of its complete groups,
read chunk by chunk from one snapshot of the database, as stored (token blobs, JSON text), never as
ORM objects. Whatever the batch's size, a pull holds a chunk or a few at a time."""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, fields
from functools import reduce
from typing import Any

from sqlalchemy import ColumnElement, Integer, Result, Row, Text, cast, func, select, tuple_
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from service.records import FINISHED_STATUSES, TRAINABLE_STATUSES, EpisodeStatus
from service.storage import blobs
from service.storage.db import IN_LIST_CHUNK, Database
from service.storage.groups import RewardStats
from service.storage.models import TOKEN_COLUMNS, Batch, Episode, EpisodeSegment

# Token blob bytes per chunk: what one pull holds in memory at a time, a few times over (the rows,
# the record batch being built, the one being sent).
CHUNK_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True)
class EpisodeColumns:
    """Some episodes of a batch, column by column, by group then sample. The token arrays are the
    stored little-endian blobs (see `blobs`; None where an episode stored none) and turns, messages
    and info the stored JSON text (None for SQL NULL)."""

    episode_id: Sequence[str]
    batch_id: Sequence[str]
    group_index: Sequence[int]
    sample_index: Sequence[int]
    task_index: Sequence[int]
    status: Sequence[str]
    reward: Sequence[float | None]
    attempt: Sequence[int]
    num_turns: Sequence[int | None]
    prompt_ids: Sequence[bytes | None]
    response_ids: Sequence[bytes | None]
    loss_mask: Sequence[bytes | None]
    rollout_logprobs: Sequence[bytes | None]
    error: Sequence[str | None]
    turns_json: Sequence[str | None]
    messages_json: Sequence[str | None]
    info_json: Sequence[str | None]
    # An external agent's episode can have several segments (service/agents): each is a row of its
    # own, the row of the episode itself being its last segment.
    segment: Sequence[int]
    segments: Sequence[int]

    def __len__(self) -> int:
        return len(self.episode_id)


def _source(name: str) -> ColumnElement[Any]:
    # JSON columns are read as their text: the Arrow stream carries them as text, so decoding them
    # here would only be undone there.
    if name.endswith("_json"):
        return cast(Episode.__table__.c[name.removesuffix("_json")], Text)
    if name == "segment":
        return (Episode.segments - 1).label("segment")
    return Episode.__table__.c["id" if name == "episode_id" else name]


# The select list, in the order of EpisodeColumns' fields.
_SELECTED = [_source(field.name) for field in fields(EpisodeColumns)]
_COLUMN_NAMES = [field.name for field in fields(EpisodeColumns)]
# What a segment has of its own; the rest of its row is its episode's.
_SEGMENT_OWN = (*(column.key for column in TOKEN_COLUMNS), "turns_json", "messages_json")
_SEGMENT_SELECTED = [
    EpisodeSegment.episode_id,
    EpisodeSegment.segment,
    EpisodeSegment.prompt_ids,
    EpisodeSegment.response_ids,
    EpisodeSegment.loss_mask,
    EpisodeSegment.rollout_logprobs,
    cast(EpisodeSegment.turns, Text).label("turns_json"),
    cast(EpisodeSegment.messages, Text).label("messages_json"),
    func.json_array_length(EpisodeSegment.turns).label("calls"),
]
# What an episode's token blobs weigh, read without reading them (from the row or TOAST header).
_TOKEN_BYTES = reduce(operator.add, [func.coalesce(func.length(column), 0) for column in TOKEN_COLUMNS])


def _token_count(column: Any) -> ColumnElement[int]:
    """An ids blob's length in tokens, read without reading it (from the row or TOAST header)."""
    return func.length(column, type_=Integer) // blobs.ID_BYTES


# An episode's summary, labelled as the API's EpisodeSummary names its fields: its scalar columns
# and its token arrays' lengths, the blobs unread.
SUMMARY_SELECTED = (
    Episode.id,
    Episode.status,
    Episode.reward,
    Episode.group_index,
    Episode.sample_index,
    Episode.task_index,
    Episode.attempt,
    Episode.num_turns,
    _token_count(Episode.prompt_ids).label("prompt_length"),
    _token_count(Episode.response_ids).label("response_length"),
    Episode.error,
    Episode.status.in_(sorted(status.value for status in TRAINABLE_STATUSES)).label("trainable"),
)
# A batch's own fields, labelled as the API's BatchInfo names them.
BATCH_SELECTED = (
    Batch.id.label("batch_id"),
    Batch.env,
    Batch.task_split,
    Batch.metadata_.label("metadata"),
    Batch.created_at,
    Batch.cancelled_at,
)


@dataclass(frozen=True)
class BatchHead:
    """The batch itself and where its episodes stand, in the snapshot its rows are read from."""

    batch: dict[str, Any]  # BATCH_SELECTED, by label
    counts: dict[str, int]  # every status a key
    groups_total: int
    complete_groups: dict[int, int]  # group index -> its episodes, for the complete groups, in order
    group_stats: dict[int, RewardStats]  # of the complete groups

    @property
    def batch_id(self) -> str:
        return str(self.batch["batch_id"])

    @property
    def groups_complete(self) -> int:
        return len(self.complete_groups)


class EpisodeRows:
    """Some episodes in one read snapshot, held open until `aclose()`, which `chunks()` reads in
    the order `_sizes()` gives them."""

    def __init__(self, session: AsyncSession, connection: AsyncConnection, chunk_bytes: int) -> None:
        self._session = session
        self._connection = connection
        self._chunk_bytes = chunk_bytes

    async def _sizes(self) -> list[tuple[str, int]]:
        """The episodes' ids in order, with their token arrays' bytes."""
        raise NotImplementedError

    async def chunks(self) -> AsyncIterator[EpisodeColumns]:
        """The episodes in order, a chunk of about `chunk_bytes` of token arrays at a time."""
        for ids in _chunk_plan(await self._sizes(), self._chunk_bytes):
            rows: list[Row[Any]] = list(
                await self._connection.execute(select(*_SELECTED).where(Episode.id.in_(ids)))
            )
            position = {episode_id: index for index, episode_id in enumerate(ids)}
            rows.sort(key=lambda row: position[row[0]])  # by primary key: no server-side sort of blobs
            if any(row.segments > 1 for row in rows):
                rows = await self._with_earlier_segments(rows)
            yield EpisodeColumns(*zip(*rows, strict=True))

    async def _with_earlier_segments(self, rows: list[Row[Any]]) -> list[Any]:
        """The rows with each episode's earlier segments before it, as rows of their own."""
        rows_by_name = [dict(zip(_COLUMN_NAMES, row, strict=True)) for row in rows]
        several = [row["episode_id"] for row in rows_by_name if row["segments"] > 1]
        earlier: dict[str, list[Row[Any]]] = {}
        for segment in await self._connection.execute(
            select(*_SEGMENT_SELECTED)
            .where(EpisodeSegment.episode_id.in_(several))
            .order_by(EpisodeSegment.segment)
        ):
            earlier.setdefault(segment.episode_id, []).append(segment)
        spliced: list[Any] = []
        for row, values in zip(rows, rows_by_name, strict=True):
            for segment in earlier.get(values["episode_id"], ()):
                own = {name: getattr(segment, name) for name in _SEGMENT_OWN}
                own |= {"segment": segment.segment, "num_turns": segment.calls}
                spliced.append(tuple((values | own)[name] for name in _COLUMN_NAMES))
            spliced.append(row)
        return spliced

    async def aclose(self) -> None:
        """Ends the read transaction and returns the connection; safe to call more than once."""
        await self._session.close()


class BatchRows(EpisodeRows):
    """A batch in one read snapshot: its head, and the episodes of the groups that were complete
    when it was opened, which `chunks()` and `summaries()` read."""

    def __init__(
        self, session: AsyncSession, connection: AsyncConnection, head: BatchHead, chunk_bytes: int
    ) -> None:
        super().__init__(session, connection, chunk_bytes)
        self.head = head

    async def _sizes(self) -> list[tuple[str, int]]:
        rows = await self._connection.execute(
            select(Episode.id, Episode.group_index, _TOKEN_BYTES.label("token_bytes"))
            .where(Episode.batch_id == self.head.batch_id)
            .order_by(Episode.group_index, Episode.sample_index)
        )
        complete = self.head.complete_groups
        return [(row.id, row.token_bytes) for row in rows if row.group_index in complete]

    async def summaries(self, groups: Sequence[int]) -> AsyncIterator[list[Row[Any]]]:
        """The summaries (SUMMARY_SELECTED) of the episodes of `groups` (complete ones), by group
        then sample, whole groups of about IN_LIST_CHUNK episodes at a time."""
        sizes = self.head.complete_groups
        chunk: list[int] = []
        size = 0
        for group in groups:
            if chunk and size + sizes[group] > IN_LIST_CHUNK:
                yield await self._summary_rows(chunk)
                chunk, size = [], 0
            chunk.append(group)
            size += sizes[group]
        if chunk:
            yield await self._summary_rows(chunk)

    async def _summary_rows(self, groups: list[int]) -> list[Row[Any]]:
        statement = (
            select(*SUMMARY_SELECTED)
            .where(Episode.batch_id == self.head.batch_id, Episode.group_index.in_(groups))
            .order_by(Episode.group_index, Episode.sample_index)
        )
        return list(await self._connection.execute(statement))


class GroupRows(EpisodeRows):
    """The episodes of some complete groups (of any batches), by group in the given order, then
    sample. Complete groups never change: no snapshot is needed."""

    def __init__(
        self,
        session: AsyncSession,
        connection: AsyncConnection,
        keys: Sequence[tuple[str, int]],
        chunk_bytes: int,
    ) -> None:
        super().__init__(session, connection, chunk_bytes)
        self.keys = list(keys)

    async def _sizes(self) -> list[tuple[str, int]]:
        sizes: list[tuple[str, int]] = []
        for start in range(0, len(self.keys), IN_LIST_CHUNK // 8):  # about 8 episodes a group
            chunk = self.keys[start : start + IN_LIST_CHUNK // 8]
            order = {key: index for index, key in enumerate(chunk)}
            rows = list(
                await self._connection.execute(
                    select(Episode.id, Episode.batch_id, Episode.group_index, Episode.sample_index)
                    .add_columns(_TOKEN_BYTES.label("token_bytes"))
                    .where(tuple_(Episode.batch_id, Episode.group_index).in_(chunk))
                )
            )
            rows.sort(key=lambda row: (order[(row.batch_id, row.group_index)], row.sample_index))
            sizes.extend((row.id, row.token_bytes) for row in rows)
        return sizes

    async def summaries(self) -> list[Row[Any]]:
        """The summaries (SUMMARY_SELECTED, with batch_id) of the groups' episodes, in order."""
        rows: list[Row[Any]] = []
        for start in range(0, len(self.keys), IN_LIST_CHUNK // 8):
            chunk = self.keys[start : start + IN_LIST_CHUNK // 8]
            order = {key: index for index, key in enumerate(chunk)}
            part: list[Row[Any]] = list(
                await self._connection.execute(
                    select(*SUMMARY_SELECTED, Episode.batch_id).where(
                        tuple_(Episode.batch_id, Episode.group_index).in_(chunk)
                    )
                )
            )
            part.sort(key=lambda row: (order[(row.batch_id, row.group_index)], row.sample_index))
            rows.extend(part)
        return rows


def _without_snapshot(database: Database) -> dict[str, Any]:
    """Execution options of a PostgreSQL read that needs no snapshot: each statement on its own
    (AUTOCOMMIT), but inside a transaction behind a transaction-mode pooler, which may otherwise run
    a statement's prepare and its execution on two server connections ("prepared statement ... does
    not exist", seen in test_pgbouncer)."""
    return {} if database.transaction_pooler else {"isolation_level": "AUTOCOMMIT"}


async def open_group_rows(
    database: Database, keys: Sequence[tuple[str, int]], *, chunk_bytes: int = CHUNK_BYTES
) -> GroupRows:
    session = database.reader()
    try:
        options = _without_snapshot(database) if database.engine.dialect.name == "postgresql" else {}
        connection = await session.connection(execution_options=options)
    except BaseException:
        await session.close()
        raise
    return GroupRows(session, connection, keys, chunk_bytes)


def _reward_stats(parts: Sequence[Row[Any]]) -> RewardStats:
    """A group's reward statistics from its per-status aggregates."""
    if not parts:
        return RewardStats.of([])
    return RewardStats.from_sums(
        sum(part.rewards for part in parts),
        sum(part.total for part in parts),
        sum(part.squares for part in parts),
        min(part.low for part in parts),
        max(part.high for part in parts),
    )


def _chunk_plan(ids_and_sizes: Sequence[tuple[str, int]], chunk_bytes: int) -> list[list[str]]:
    plan: list[list[str]] = []
    current: list[str] = []
    size = 0
    for episode_id, episode_bytes in ids_and_sizes:
        if current and (size + episode_bytes > chunk_bytes or len(current) >= IN_LIST_CHUNK):
            plan.append(current)
            current, size = [], 0
        current.append(episode_id)
        size += episode_bytes
    if current:
        plan.append(current)
    return plan


async def open_batch_rows(
    database: Database, batch_id: str, *, chunk_bytes: int = CHUNK_BYTES, snapshot: bool = True
) -> BatchRows | None:
    """Opens a read snapshot of the batch and reads its head: its counts, and which groups are
    complete (their episodes are the ones it sends); None, with nothing left open, if there is no
    such batch.

    One snapshot: on PostgreSQL a REPEATABLE READ transaction, on SQLite a deferred read
    transaction of WAL mode. So the chunks read later are exactly the episodes decided here, with
    the values they had then, whatever finishes meanwhile. `snapshot=False` spares PostgreSQL the
    transaction (each statement then reads the latest commits) for reads that need none: the
    summaries of complete groups, which never change once complete.
    """
    session = database.reader()
    try:
        options: dict[str, Any] = {}
        if database.engine.dialect.name == "postgresql":
            options = (
                {"isolation_level": "REPEATABLE READ", "postgresql_readonly": True}
                if snapshot
                else _without_snapshot(database)
            )
        connection = await session.connection(execution_options=options)
        batch = (await connection.execute(select(*BATCH_SELECTED).where(Batch.id == batch_id))).first()
        if batch is None:
            await session.close()
            return None
        # Counted by the database: one row per group and status, not one per episode.
        rows: Result[Any] = await connection.execute(
            select(
                Episode.group_index,
                Episode.status,
                func.count().label("episodes"),
                func.count(Episode.reward).label("rewards"),
                func.sum(Episode.reward).label("total"),
                func.sum(Episode.reward * Episode.reward).label("squares"),
                func.min(Episode.reward).label("low"),
                func.max(Episode.reward).label("high"),
            )
            .where(Episode.batch_id == batch_id)
            .group_by(Episode.group_index, Episode.status)
        )
    except BaseException:
        await session.close()
        raise
    counts = {status.value: 0 for status in EpisodeStatus}
    sizes: Counter[int] = Counter()
    unfinished: set[int] = set()
    rewards: dict[int, list[Row[Any]]] = {}
    for row in rows:
        counts[row.status] += row.episodes
        sizes[row.group_index] += row.episodes
        if row.status not in FINISHED_STATUSES:
            unfinished.add(row.group_index)
        if row.rewards:
            rewards.setdefault(row.group_index, []).append(row)
    complete = [group for group in sorted(sizes) if group not in unfinished]
    head = BatchHead(
        batch=batch._asdict(),
        counts=counts,
        groups_total=len(sizes),
        complete_groups={group: sizes[group] for group in complete},
        group_stats={group: _reward_stats(rewards.get(group, [])) for group in complete},
    )
    return BatchRows(session, connection, head, chunk_bytes)
