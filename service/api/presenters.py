"""Stored episodes and batches as the API answers them: JSON bodies, and the trainer's Arrow stream.

Token arrays go from the stored little-endian blobs straight into Arrow list columns (one
concatenation and an offsets array), never through Python lists of numbers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from itertools import accumulate
from typing import Any

import pyarrow as pa

from service.api.schemas import BatchOut, EpisodeDetail, EpisodeSummary, EpisodeWithTokens
from service.records import FINISHED_STATUSES, TurnRecord
from service.storage import blobs
from service.storage.batches import BatchView, StoredEpisode
from service.storage.models import Episode

ARROW_STREAM_MEDIA_TYPE = "application/vnd.apache.arrow.stream"


def _summary_fields(stored: StoredEpisode) -> dict[str, Any]:
    episode = stored.episode
    return {
        "id": episode.id,
        "status": episode.status,
        "reward": episode.reward,
        "group_index": episode.group_index,
        "sample_index": episode.sample_index,
        "task_index": episode.task_index,
        "attempt": episode.attempt,
        "num_turns": episode.num_turns,
        "prompt_length": stored.prompt_length,
        "response_length": stored.response_length,
        "error": episode.error,
    }


def _token_fields(episode: Episode) -> dict[str, Any]:
    tokens = episode.tokens()
    return {
        "prompt_ids": tokens.prompt_ids if tokens else None,
        "response_ids": tokens.response_ids if tokens else None,
        "loss_mask": tokens.loss_mask if tokens else None,
        "rollout_logprobs": tokens.rollout_logprobs if tokens else None,
        "weight_versions": [turn.get("weight_version") for turn in episode.turns or []],
    }


def episode_detail(episode: Episode) -> EpisodeDetail:
    tokens = _token_fields(episode)
    lengths = StoredEpisode(
        episode,
        prompt_length=None if tokens["prompt_ids"] is None else len(tokens["prompt_ids"]),
        response_length=None if tokens["response_ids"] is None else len(tokens["response_ids"]),
    )
    turns = [TurnRecord(**turn) for turn in episode.turns or []]
    return EpisodeDetail(
        **_summary_fields(lengths),
        **tokens,
        batch_id=episode.batch_id,
        env=episode.env,
        task_split=episode.task_split,
        sampling_params=episode.sampling_params,
        max_turns=episode.max_turns,
        messages=episode.messages,
        info=episode.info,
        finish_reasons=[turn.finish_reason for turn in turns],
        turns=turns,
        created_at=episode.created_at,
        started_at=episode.started_at,
        finished_at=episode.finished_at,
    )


def batch_json(view: BatchView, *, include_tokens: bool) -> bytes:
    episodes: list[EpisodeWithTokens] | list[EpisodeSummary]
    if include_tokens:
        episodes = [
            EpisodeWithTokens(**_summary_fields(stored), **_token_fields(stored.episode))
            for stored in view.episodes
        ]
    else:
        episodes = [EpisodeSummary(**_summary_fields(stored)) for stored in view.episodes]
    counts, batch = view.counts, view.batch
    total = sum(counts.values())
    finished = sum(counts[status] for status in FINISHED_STATUSES)
    body = BatchOut(
        batch_id=batch.id,
        env=batch.env,
        task_split=batch.task_split,
        metadata=batch.metadata_,
        created_at=batch.created_at,
        counts=counts,
        total=total,
        finished=finished,
        complete=finished == total,
        groups_complete=view.groups_complete,
        groups_total=view.groups_total,
        episodes=episodes,
    )
    return body.model_dump_json().encode()


ARROW_SCHEMA = pa.schema(
    [
        ("episode_id", pa.string()),
        ("batch_id", pa.string()),
        ("group_index", pa.int32()),
        ("sample_index", pa.int32()),
        ("task_index", pa.int32()),
        ("status", pa.string()),
        ("reward", pa.float64()),
        ("attempt", pa.int32()),
        ("num_turns", pa.int32()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("response_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.uint8())),
        ("rollout_logprobs", pa.list_(pa.float64())),
        ("weight_versions", pa.list_(pa.string())),
        ("finish_reasons", pa.list_(pa.string())),
        ("error", pa.string()),
        ("messages_json", pa.string()),
        ("info_json", pa.string()),
    ],
    metadata={"format": "rollout-service episodes v1"},
)


def _list_column(blobs: Sequence[bytes | None], value_type: pa.DataType, width: int) -> pa.Array:
    lengths = [len(blob or b"") // width for blob in blobs]
    offsets = pa.array([0, *accumulate(lengths)], type=pa.int32())
    data = pa.py_buffer(b"".join(blob or b"" for blob in blobs))
    values = pa.Array.from_buffers(value_type, sum(lengths), [None, data])
    return pa.ListArray.from_arrays(offsets, values)


def batch_arrow(view: BatchView) -> bytes:
    """One Arrow IPC stream, one row per episode of the batch's complete groups, tokens included."""
    episodes = [stored.episode for stored in view.episodes]
    turns = [episode.turns or [] for episode in episodes]
    columns = [
        pa.array([episode.id for episode in episodes], pa.string()),
        pa.array([episode.batch_id for episode in episodes], pa.string()),
        pa.array([episode.group_index for episode in episodes], pa.int32()),
        pa.array([episode.sample_index for episode in episodes], pa.int32()),
        pa.array([episode.task_index for episode in episodes], pa.int32()),
        pa.array([episode.status for episode in episodes], pa.string()),
        pa.array([episode.reward for episode in episodes], pa.float64()),
        pa.array([episode.attempt for episode in episodes], pa.int32()),
        pa.array([episode.num_turns for episode in episodes], pa.int32()),
        _list_column([episode.prompt_ids for episode in episodes], pa.int32(), blobs.ID_BYTES),
        _list_column([episode.response_ids for episode in episodes], pa.int32(), blobs.ID_BYTES),
        _list_column([episode.loss_mask for episode in episodes], pa.uint8(), blobs.MASK_BYTES),
        _list_column([episode.rollout_logprobs for episode in episodes], pa.float64(), blobs.LOGPROB_BYTES),
        pa.array([[turn.get("weight_version") for turn in rows] for rows in turns], pa.list_(pa.string())),
        pa.array(
            [[(turn.get("finish_reason") or {}).get("type") for turn in rows] for rows in turns],
            pa.list_(pa.string()),
        ),
        pa.array([episode.error for episode in episodes], pa.string()),
        pa.array([json.dumps(episode.messages) for episode in episodes], pa.string()),
        pa.array([json.dumps(episode.info) for episode in episodes], pa.string()),
    ]
    table = pa.Table.from_arrays(columns, schema=ARROW_SCHEMA)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, ARROW_SCHEMA) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue())
