"""The database schema: a batch is one submitted request; each of its episodes is one queued job."""

from __future__ import annotations

from dataclasses import fields
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    TypeDecorator,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from service import records
from service.records import EpisodeRequest, EpisodeStatus
from service.storage import blobs
from service.text import replace_unstorable, unstorable

# Explicit constraint names, so migrations can drop and alter them on every backend.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on every backend.

    SQLite has no time zones: values are stored as naive UTC text (whose order is time order) and
    come back with tzinfo=UTC. Naive datetimes are refused rather than guessed at.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: use service.storage.db.utcnow()")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class TextColumn(TypeDecorator[str]):
    """A text column that holds the same on every database: PostgreSQL's text cannot hold NUL and
    neither database can encode a lone surrogate, so both are refused before the statement runs, on
    SQLite too. Requests never get here with either (service/api/values.py refuses them with a
    422 naming the field); this keeps a new path from storing on one database what fails on the other."""

    impl = String
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Dialect) -> str | None:
        if value is not None and (found := unstorable(value, column=True)) is not None:
            kind, at, _ = found
            where = "check it where it enters (service/api/values.py)"
            raise ValueError(f"{kind} at character {at} in {value[:80]!r}: {where}")
        return value


class DiagnosticText(TypeDecorator[str]):
    """Free text the service writes itself (an episode's error: an env's or engine's message). It is
    for reading, so what no database can hold is replaced by U+FFFD rather than failing the write."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Dialect) -> str | None:
        return None if value is None else replace_unstorable(value)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: UTCDateTime(), dict[str, Any]: JSON(), list[Any]: JSON()}


class Batch(Base):
    __tablename__ = "batches"
    __table_args__ = (Index("ix_batches_created_at_id", "created_at", "id"),)  # newest first: GET /batches

    id: Mapped[str] = mapped_column(TextColumn(128), primary_key=True)
    # Hash of the normalized request: a resubmission with the same id and hash gets the same
    # answer, with the same id and another hash a 409.
    request_hash: Mapped[str] = mapped_column(TextColumn(64))
    env: Mapped[str] = mapped_column(TextColumn(128))
    task_split: Mapped[str] = mapped_column(TextColumn(64))
    metadata_: Mapped[dict[str, Any]] = mapped_column("metadata", JSON)
    created_at: Mapped[datetime]
    # Set by POST /batches/{id}/cancel; workers look it up for the batches of their running episodes.
    cancelled_at: Mapped[datetime | None]

    episodes: Mapped[list[Episode]] = relationship(back_populates="batch", lazy="raise")


class Episode(Base):
    """One rollout and, while unfinished, its job: status, attempt and lease drive the queue."""

    __tablename__ = "episodes"
    __table_args__ = (
        CheckConstraint(
            "status IN ({})".format(", ".join(f"'{status.value}'" for status in EpisodeStatus)),
            name="status",
        ),
        Index("ix_episodes_status_created_at", "status", "created_at"),
        Index("ix_episodes_status_lease_expires_at", "status", "lease_expires_at"),
        # A group's episodes: whether it is complete, its rewards (storage/groups.py).
        Index("ix_episodes_batch_id_group_index", "batch_id", "group_index"),
        # A batch's episodes by status: whether any is unfinished (a long-poll asks after each result
        # stored), its counts, its cancel. By batch alone, each row of the batch was read for its
        # status: a check of a 10,000-episode batch near its end took 1.9-2.8 ms of the service's
        # CPU on SQLite against 0.5-0.6 ms now; on PostgreSQL 1.6 ms against 0.4 ms of wall time.
        Index("ix_episodes_batch_id_status", "batch_id", "status"),
    )

    id: Mapped[str] = mapped_column(TextColumn(64), primary_key=True)
    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"))  # indexes above
    group_index: Mapped[int] = mapped_column(Integer)  # index of the task in the request: a GRPO group
    sample_index: Mapped[int] = mapped_column(Integer)  # index of the sample within its group
    # The EpisodeRequest, one column per field (see REQUEST_COLUMNS).
    env: Mapped[str] = mapped_column(TextColumn(128))
    task_split: Mapped[str] = mapped_column(TextColumn(64))
    task_index: Mapped[int] = mapped_column(Integer)
    sampling_params: Mapped[dict[str, Any]] = mapped_column(JSON)
    max_turns: Mapped[int] = mapped_column(Integer)
    max_response_tokens: Mapped[int | None] = mapped_column(Integer)
    max_staleness: Mapped[int | None] = mapped_column(Integer)
    episode_timeout_seconds: Mapped[float | None] = mapped_column(Float)

    status: Mapped[str] = mapped_column(TextColumn(16))
    # Fencing token: +1 on every re-queue, so a worker that lost its lease cannot finish the row.
    attempt: Mapped[int] = mapped_column(Integer)
    # Attempts that ended by a crash, a kill or an unreachable engine (graceful releases on
    # shutdown do not count): at MAX_ATTEMPTS of them the episode fails.
    failures: Mapped[int] = mapped_column(Integer, server_default="0")
    lease_owner: Mapped[str | None] = mapped_column(TextColumn(128))
    lease_expires_at: Mapped[datetime | None]

    reward: Mapped[float | None] = mapped_column(Float)
    prompt_ids: Mapped[bytes | None] = mapped_column(LargeBinary)  # int32 LE, see blobs
    response_ids: Mapped[bytes | None] = mapped_column(LargeBinary)  # int32 LE
    loss_mask: Mapped[bytes | None] = mapped_column(LargeBinary)  # uint8
    rollout_logprobs: Mapped[bytes | None] = mapped_column(LargeBinary)  # float64 LE
    messages: Mapped[list[Any] | None] = mapped_column(JSON)
    info: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # Per-turn records: weight_version, finish_reason, engine_seconds, env_seconds, ...
    turns: Mapped[list[Any] | None] = mapped_column(JSON)
    error: Mapped[str | None] = mapped_column(DiagnosticText)
    num_turns: Mapped[int | None] = mapped_column(Integer)

    created_at: Mapped[datetime]
    started_at: Mapped[datetime | None]  # start of the latest attempt
    finished_at: Mapped[datetime | None]
    # An external agent's episode (env `external`): the bearer token of its OpenAI endpoint, and
    # how many segments it has (a rewritten history starts one). This row holds the last segment;
    # EpisodeSegment rows the ones before it.
    agent_token: Mapped[str | None] = mapped_column(TextColumn(64))
    # An agent-driven episode re-queued: the token of its last attempt that had one (storage/
    # driven.py), so that only its holder is told the episode was re-queued. Kept as the token
    # itself: the live one is stored so too, and a dead one opens nothing.
    dead_agent_token: Mapped[str | None] = mapped_column(TextColumn(64))
    segments: Mapped[int] = mapped_column(Integer, server_default="1")

    batch: Mapped[Batch] = relationship(back_populates="episodes", lazy="raise")

    def tokens(self) -> records.EpisodeTokens | None:
        """The decoded token arrays, or None when the episode stored none (unfinished, failed)."""
        if self.prompt_ids is None or self.response_ids is None:
            return None
        return blobs.decode_tokens(self.prompt_ids, self.response_ids, self.loss_mask, self.rollout_logprobs)


class Group(Base):
    """One GRPO group of a batch (its samples of one task), inserted with the batch. Once every one
    of its episodes has a final status it is logged complete: `seq` places it in the stream of
    complete groups (GET /groups), in the order they completed, and its reward statistics are
    stored with it. Complete groups never change again."""

    __tablename__ = "groups"

    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True)
    group_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    env: Mapped[str] = mapped_column(TextColumn(128))
    task_index: Mapped[int] = mapped_column(Integer)
    size: Mapped[int] = mapped_column(Integer)  # its episodes
    created_at: Mapped[datetime]
    # Its place in the stream of complete groups: 1, 2, 3... in commit order (NULL: not complete).
    seq: Mapped[int | None] = mapped_column(Integer, unique=True)
    completed_at: Mapped[datetime | None]
    # Over its episodes that have a reward (None: none has); std is the population's (ddof 0).
    reward_count: Mapped[int | None] = mapped_column(Integer)
    reward_mean: Mapped[float | None] = mapped_column(Float)
    reward_std: Mapped[float | None] = mapped_column(Float)
    reward_min: Mapped[float | None] = mapped_column(Float)
    reward_max: Mapped[float | None] = mapped_column(Float)


class EngineState(Base):
    """What every process of the service shares about the engine, in one row (id 1): the newest
    weight version any of them sampled from (`max_staleness` is measured against it), and a pause
    (POST /engine/pause) not continued yet: since when, by which process, in which mode."""

    __tablename__ = "engine_state"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    newest_weight_version: Mapped[int | None] = mapped_column(BigInteger)
    paused_at: Mapped[datetime | None]
    paused_by: Mapped[str | None] = mapped_column(TextColumn(128))
    pause_mode: Mapped[str | None] = mapped_column(TextColumn(16))


# The columns that hold an EpisodeRequest, named as its fields.
REQUEST_COLUMNS = tuple(Episode.__table__.c[field.name] for field in fields(EpisodeRequest))
TOKEN_COLUMNS = tuple(getattr(Episode, name) for name in blobs.TOKEN_BLOBS)


class EpisodeSegment(Base):
    """A closed segment of an external agent's episode: a training sample of its own (its own
    prompt) that shares the episode's id, reward and status (see service/agents)."""

    __tablename__ = "episode_segments"

    episode_id: Mapped[str] = mapped_column(ForeignKey("episodes.id", ondelete="CASCADE"), primary_key=True)
    segment: Mapped[int] = mapped_column(Integer, primary_key=True)
    prompt_ids: Mapped[bytes] = mapped_column(LargeBinary)
    response_ids: Mapped[bytes] = mapped_column(LargeBinary)
    loss_mask: Mapped[bytes] = mapped_column(LargeBinary)
    rollout_logprobs: Mapped[bytes] = mapped_column(LargeBinary)
    turns: Mapped[list[Any]] = mapped_column(JSON)
    messages: Mapped[list[Any]] = mapped_column(JSON)

    def tokens(self) -> records.EpisodeTokens:
        return blobs.decode_tokens(self.prompt_ids, self.response_ids, self.loss_mask, self.rollout_logprobs)
