"""Storage: the schema, the episode queue, and token arrays as binary blobs."""

from service.storage.batches import (
    NewEpisode,
    batch_status_counts,
    enqueue_batch,
    get_batch,
    load_batch_episodes,
    queue_depth,
    status_counts,
)
from service.storage.db import Database, make_engine, make_sessionmaker, run_migrations, utcnow
from service.storage.models import Batch, Episode, EpisodeStatus, EpisodeTokens
from service.storage.queue import (
    ClaimedEpisode,
    EpisodeOutcome,
    claim_episodes,
    finish_episode,
    release_episodes,
    renew_leases,
    requeue_expired,
)

__all__ = [
    "Batch",
    "ClaimedEpisode",
    "Database",
    "Episode",
    "EpisodeOutcome",
    "EpisodeStatus",
    "EpisodeTokens",
    "NewEpisode",
    "batch_status_counts",
    "claim_episodes",
    "enqueue_batch",
    "finish_episode",
    "get_batch",
    "load_batch_episodes",
    "make_engine",
    "make_sessionmaker",
    "queue_depth",
    "release_episodes",
    "renew_leases",
    "requeue_expired",
    "run_migrations",
    "status_counts",
    "utcnow",
]
