"""Stored episodes and batches as the API answers them: JSON bodies, and the trainer's Arrow stream.

Token arrays go from the stored little-endian blobs straight into Arrow list columns (one
concatenation and an offsets array), never through Python lists of numbers.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from itertools import accumulate
from typing import Any

import orjson
import pyarrow as pa
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from service.api.schemas import BatchOut, EpisodeDetail, EpisodeSummary, EpisodeWithTokens
from service.records import FINISHED_STATUSES, TurnRecord
from service.storage import blobs
from service.storage.batch_rows import BatchRows, EpisodeColumns
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


# The stream is the schema's IPC message, a record batch message per chunk, and this end marker
# (a continuation token and a zero length): Arrow's IPC streaming format.
ARROW_STREAM_END = b"\xff\xff\xff\xff\x00\x00\x00\x00"
SEND_BYTES = 1024 * 1024  # body pieces handed to the server: the socket drains one while the next waits
PREFETCH_CHUNKS = 2  # record batches encoded or being encoded ahead of the one being sent


def _list_column(blobs: Sequence[bytes | None], value_type: pa.DataType, width: int) -> pa.Array:
    lengths = []
    for blob in blobs:
        if blob and len(blob) % width:
            raise ValueError(
                f"a stored array of {len(blob)} bytes is not a whole number of {width}-byte items"
            )
        lengths.append(len(blob) // width if blob else 0)
    offsets = pa.array([0, *accumulate(lengths)], type=pa.int32())
    data = pa.py_buffer(b"".join(blob or b"" for blob in blobs))
    values = pa.Array.from_buffers(value_type, sum(lengths), [None, data])
    return pa.ListArray.from_arrays(offsets, values)


def _json_text(text: str | None) -> str:
    return "null" if text is None else text  # SQL NULL reads as the JSON of None, as json.dumps(None)


def arrow_record_batch(columns: EpisodeColumns) -> pa.Buffer:
    """Some episodes as one Arrow IPC record batch message (of ARROW_SCHEMA): the token arrays go
    from the stored blobs into list columns with one copy, the JSON text goes as stored."""
    turns = [(orjson.loads(text) if text is not None else None) or [] for text in columns.turns_json]
    arrays = [
        pa.array(columns.episode_id, pa.string()),
        pa.array(columns.batch_id, pa.string()),
        pa.array(columns.group_index, pa.int32()),
        pa.array(columns.sample_index, pa.int32()),
        pa.array(columns.task_index, pa.int32()),
        pa.array(columns.status, pa.string()),
        pa.array(columns.reward, pa.float64()),
        pa.array(columns.attempt, pa.int32()),
        pa.array(columns.num_turns, pa.int32()),
        _list_column(columns.prompt_ids, pa.int32(), blobs.ID_BYTES),
        _list_column(columns.response_ids, pa.int32(), blobs.ID_BYTES),
        _list_column(columns.loss_mask, pa.uint8(), blobs.MASK_BYTES),
        _list_column(columns.rollout_logprobs, pa.float64(), blobs.LOGPROB_BYTES),
        pa.array([[turn.get("weight_version") for turn in rows] for rows in turns], pa.list_(pa.string())),
        pa.array(
            [[(turn.get("finish_reason") or {}).get("type") for turn in rows] for rows in turns],
            pa.list_(pa.string()),
        ),
        pa.array(columns.error, pa.string()),
        pa.array([_json_text(text) for text in columns.messages_json], pa.string()),
        pa.array([_json_text(text) for text in columns.info_json], pa.string()),
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=ARROW_SCHEMA).serialize()


class ArrowStreamResponse(StreamingResponse):
    """A batch as an Arrow IPC stream, one record batch per chunk of `rows`, in a pipeline: while
    one chunk is sent, the next ones are encoded (on threads: the event loop runs the episodes
    meanwhile) and read. Chunked, since its length is known only at the end, so an error once the
    status line went out can only cut the stream short: the client sees a body without the end
    marker.

    It owns `rows`: the read snapshot is closed however the response ends (sent, the client gone,
    an error)."""

    media_type = ARROW_STREAM_MEDIA_TYPE

    def __init__(self, rows: BatchRows) -> None:
        self._rows = rows
        self._reader: asyncio.Task[None] | None = None
        self._stream = self._body()
        super().__init__(self._stream)

    async def _read(self, messages: asyncio.Queue[asyncio.Future[pa.Buffer] | None]) -> None:
        try:
            async for columns in self._rows.chunks():
                await messages.put(asyncio.ensure_future(asyncio.to_thread(arrow_record_batch, columns)))
        except Exception as error:  # the database's: the body raises it where this chunk goes
            failed: asyncio.Future[pa.Buffer] = asyncio.get_running_loop().create_future()
            failed.set_exception(error)
            await messages.put(failed)
        else:
            await messages.put(None)

    async def _body(self) -> AsyncGenerator[bytes | memoryview]:
        messages: asyncio.Queue[asyncio.Future[pa.Buffer] | None] = asyncio.Queue(PREFETCH_CHUNKS)
        self._reader = asyncio.create_task(self._read(messages))
        yield ARROW_SCHEMA.serialize().to_pybytes()
        while (encoding := await messages.get()) is not None:
            view = memoryview(await encoding)
            for start in range(0, len(view), SEND_BYTES):
                yield view[start : start + SEND_BYTES]
        yield ARROW_STREAM_END

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # Here, past Starlette's task group, whose cancellation (the client went away) would
            # cancel these awaits too. The reader ends before its snapshot does.
            await self._stream.aclose()
            if self._reader is not None:
                self._reader.cancel()
                await asyncio.wait([self._reader])
            await self._rows.aclose()
