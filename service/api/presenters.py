"""Stored episodes and batches as the API answers them: JSON bodies, and the trainer's Arrow stream.

A batch is streamed, JSON and Arrow alike, a chunk of episodes at a time from one read snapshot.
Token arrays go from the stored little-endian blobs straight into Arrow list columns (one
concatenation and an offsets array) or through numpy into JSON, never through Python lists of
numbers.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import asdict
from itertools import accumulate
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
from sqlalchemy import Row
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from service.api.group_summaries import GroupSummaries
from service.api.schemas import (
    BatchGroupOut,
    BatchOut,
    EpisodeDetail,
    GroupsOut,
    RewardStatsOut,
    SegmentOut,
)
from service.records import FINISHED_STATUSES, TurnRecord
from service.storage import blobs
from service.storage.batch_rows import BatchHead, BatchRows, EpisodeColumns, EpisodeRows
from service.storage.groups import GroupPage, RewardStats
from service.storage.models import Batch, Episode, EpisodeSegment, EpisodeTokens

ARROW_STREAM_MEDIA_TYPE = "application/vnd.apache.arrow.stream"


def _summary_fields(
    episode: Episode, prompt_length: int | None, response_length: int | None
) -> dict[str, Any]:
    return {
        "id": episode.id,
        "status": episode.status,
        "reward": episode.reward,
        "group_index": episode.group_index,
        "sample_index": episode.sample_index,
        "task_index": episode.task_index,
        "attempt": episode.attempt,
        "num_turns": episode.num_turns,
        "prompt_length": prompt_length,
        "response_length": response_length,
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


def token_version_codes(
    loss_mask: np.ndarray[Any, Any], turns: Sequence[dict[str, Any]]
) -> tuple[np.ndarray[Any, np.dtype[np.int32]], list[str]]:
    """The weight version of each response token, as codes into the returned versions (-1: not
    sampled, or SGLang reported none). Sampled tokens (mask 1) are, in order, the outputs of the
    generate calls `turns` records, each `output_tokens` long."""
    versions: dict[str, int] = {}
    call_codes = [
        -1 if (version := turn.get("weight_version")) is None else versions.setdefault(version, len(versions))
        for turn in turns
    ]
    per_token = np.repeat(
        np.array(call_codes, np.int32), [int(turn.get("output_tokens") or 0) for turn in turns]
    )
    sampled = np.flatnonzero(loss_mask)
    codes = np.full(len(loss_mask), -1, np.int32)
    count = min(len(sampled), len(per_token))  # equal, unless the record is damaged
    codes[sampled[:count]] = per_token[:count]
    return codes, list(versions)


def segment_out(segment: EpisodeSegment) -> SegmentOut:
    tokens = EpisodeTokens.decoded(
        segment.prompt_ids, segment.response_ids, segment.loss_mask, segment.rollout_logprobs
    )
    return SegmentOut(
        segment=segment.segment, **asdict(tokens), turns=segment.turns, messages=segment.messages
    )


def episode_detail(episode: Episode, earlier: Sequence[EpisodeSegment] = ()) -> EpisodeDetail:
    tokens = _token_fields(episode)
    turns = [TurnRecord(**turn) for turn in episode.turns or []]
    token_versions = None
    if tokens["loss_mask"] is not None:
        codes, versions = token_version_codes(np.array(tokens["loss_mask"], np.uint8), episode.turns or [])
        names: list[str | None] = [*versions, None]  # code -1 reads the last: None
        token_versions = [names[code] for code in codes.tolist()]
    return EpisodeDetail(
        **_summary_fields(
            episode,
            prompt_length=None if tokens["prompt_ids"] is None else len(tokens["prompt_ids"]),
            response_length=None if tokens["response_ids"] is None else len(tokens["response_ids"]),
        ),
        **tokens,
        batch_id=episode.batch_id,
        env=episode.env,
        task_split=episode.task_split,
        sampling_params=episode.sampling_params,
        max_turns=episode.max_turns,
        messages=episode.messages,
        info=episode.info,
        finish_reasons=[turn.finish_reason for turn in turns],
        token_weight_versions=token_versions,
        turns=turns,
        created_at=episode.created_at,
        started_at=episode.started_at,
        finished_at=episode.finished_at,
        segment=episode.segments - 1,
        segments=episode.segments,
        earlier_segments=[segment_out(segment) for segment in earlier],
    )


def batch_info(batch: Batch) -> dict[str, Any]:
    """BatchInfo's fields of a stored batch."""
    return {
        "batch_id": batch.id,
        "env": batch.env,
        "task_split": batch.task_split,
        "metadata": batch.metadata_,
        "created_at": batch.created_at,
        "cancelled_at": batch.cancelled_at,
    }


def batch_json_head(head: BatchHead) -> tuple[bytes, bytes]:
    """A batch's JSON body (BatchOut) up to its episodes list, and what closes it: the episodes are
    streamed in between, a chunk at a time."""
    counts = head.counts
    total = sum(counts.values())
    stats = head.group_stats
    finished = sum(counts[status] for status in FINISHED_STATUSES)
    body = BatchOut(
        batch_id=head.batch_id,
        env=head.env,
        task_split=head.task_split,
        metadata=head.metadata,
        created_at=head.created_at,
        counts=counts,
        total=total,
        finished=finished,
        complete=finished == total,
        groups_complete=head.groups_complete,
        groups_total=head.groups_total,
        groups_filtered=sum(1 for group in stats.values() if not group.std),
        groups=[BatchGroupOut(group_index=group, reward=reward_stats_out(stats[group])) for group in stats],
        episodes=[],
    )
    text = body.model_dump_json().encode()
    assert text.endswith(b'"episodes":[]}'), "the episodes must be BatchOut's last field"
    return text.removesuffix(b"]}"), b"]}"


def reward_stats_out(stats: RewardStats) -> RewardStatsOut:
    return RewardStatsOut(count=stats.count, mean=stats.mean, std=stats.std, min=stats.min, max=stats.max)


def groups_page_json(page: GroupPage, episodes: Sequence[Row[Any]]) -> bytes:
    """A page of GET /groups (GroupsOut): its groups with their episodes' summaries (SUMMARY_SELECTED
    rows with batch_id, by group in the page's order, then sample)."""
    items: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in episodes:
        item = summary_item(row[: len(SUMMARY_FIELDS)])
        items.setdefault((row.batch_id, row.group_index), []).append(item)
    groups = [
        {
            "cursor": group.seq,
            "batch_id": group.batch_id,
            "group_index": group.group_index,
            "env": group.env,
            "task_index": group.task_index,
            "completed_at": group.completed_at,
            "reward": {
                "count": group.reward_count,
                "mean": group.reward_mean,
                "std": group.reward_std,
                "min": group.reward_min,
                "max": group.reward_max,
            },
            "episodes": items.get((group.batch_id, group.group_index), []),
        }
        for group in page.groups
    ]
    body = GroupsOut.model_validate({"groups": groups, "next": page.next, "filtered": page.filtered})
    return body.model_dump_json().encode()


def _byte_length(size: int | None, width: int) -> int | None:
    return None if size is None else size // width


# EpisodeSummary's fields, in the order of batch_rows.SUMMARY_SELECTED (whose two lengths are in bytes).
SUMMARY_FIELDS = (
    "id",
    "status",
    "reward",
    "group_index",
    "sample_index",
    "task_index",
    "attempt",
    "num_turns",
    "prompt_length",
    "response_length",
    "error",
)


def summary_item(values: Sequence[Any]) -> dict[str, Any]:
    """An EpisodeSummary from values in SUMMARY_FIELDS' order, the token arrays' lengths in bytes."""
    item = dict(zip(SUMMARY_FIELDS, values, strict=True))
    item["prompt_length"] = _byte_length(item["prompt_length"], blobs.ID_BYTES)
    item["response_length"] = _byte_length(item["response_length"], blobs.ID_BYTES)
    return item


def group_summaries_json(rows: Sequence[Row[Any]]) -> dict[int, bytes]:
    """Whole groups' episode summaries (SUMMARY_SELECTED rows, by group then sample) as JSON list
    items, by group index."""
    items: dict[int, list[bytes]] = {}
    for row in rows:
        items.setdefault(row.group_index, []).append(orjson.dumps(summary_item(row)))
    return {group: b",".join(texts) for group, texts in items.items()}


async def batch_summary_json(rows: BatchRows, summaries: GroupSummaries) -> bytes:
    """The batch as JSON (BatchOut) with its complete groups' summaries: those of earlier polls from
    `summaries`, the others read from `rows` and added to it."""
    head, tail = batch_json_head(rows.head)
    batch_id, complete = rows.head.batch_id, rows.head.complete_groups
    groups = summaries.of(batch_id)
    missing = [group for group in complete if group not in groups]
    async for chunk in rows.summaries(missing):
        encoded = await asyncio.to_thread(group_summaries_json, chunk)
        summaries.add(batch_id, encoded)
        groups.update(encoded)
    return head + b",".join(groups[group] for group in complete) + tail


def _numbers(blob: bytes | None, dtype: str) -> np.ndarray[Any, Any] | None:
    return None if blob is None else np.frombuffer(blob, dtype=dtype)


def episodes_with_tokens_json(columns: EpisodeColumns) -> bytes:
    """Some episodes (EpisodeWithTokens) as JSON list items: the token arrays from the stored blobs
    through numpy into orjson, never a Python number per token."""
    items = []
    for index in range(len(columns)):
        prompt, response = columns.prompt_ids[index], columns.response_ids[index]
        text = columns.turns_json[index]
        turns = (orjson.loads(text) if text is not None else None) or []
        item = summary_item(
            (
                columns.episode_id[index],
                columns.status[index],
                columns.reward[index],
                columns.group_index[index],
                columns.sample_index[index],
                columns.task_index[index],
                columns.attempt[index],
                columns.num_turns[index],
                None if prompt is None else len(prompt),
                None if response is None else len(response),
                columns.error[index],
            )
        )
        item |= {
            "prompt_ids": _numbers(prompt, blobs.ID_DTYPE),
            "response_ids": _numbers(response, blobs.ID_DTYPE),
            "loss_mask": _numbers(columns.loss_mask[index], blobs.MASK_DTYPE),
            "rollout_logprobs": _numbers(columns.rollout_logprobs[index], blobs.LOGPROB_DTYPE),
            "weight_versions": [turn.get("weight_version") for turn in turns],
            "segment": columns.segment[index],
            "segments": columns.segments[index],
        }
        items.append(orjson.dumps(item, option=orjson.OPT_SERIALIZE_NUMPY))
    return b",".join(items)


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
        # int16 codes: 2 bytes a token (a chunk's episodes name far fewer versions than 32,767).
        ("token_weight_versions", pa.list_(pa.dictionary(pa.int16(), pa.string()))),
        ("finish_reasons", pa.list_(pa.string())),
        ("error", pa.string()),
        ("messages_json", pa.string()),
        ("info_json", pa.string()),
        # An external agent's episode may have several segments, a row each (service/agents).
        ("segment", pa.int32()),
        ("segments", pa.int32()),
    ],
    metadata={"format": "rollout-service episodes v1"},
)


# The stream is the schema's IPC message, a record batch message per chunk, and this end marker
# (a continuation token and a zero length): Arrow's IPC streaming format.
ARROW_STREAM_END = b"\xff\xff\xff\xff\x00\x00\x00\x00"
ARROW_SCHEMA_MESSAGE = ARROW_SCHEMA.serialize().to_pybytes()
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


def _token_versions_column(masks: Sequence[bytes | None], turns: Sequence[list[dict[str, Any]]]) -> pa.Array:
    """token_weight_versions of some episodes: one dictionary (the versions they name) and a code
    per response token, null where not sampled. All episodes at once: their sampled tokens, in
    order, are their calls' outputs in order."""
    versions: dict[str, int] = {}
    call_codes = [
        -1 if (version := turn.get("weight_version")) is None else versions.setdefault(version, len(versions))
        for records in turns
        for turn in records
    ]
    if len(versions) > np.iinfo(np.int16).max:
        raise ValueError(
            f"{len(versions)} weight versions in one chunk of episodes: more than int16 codes hold"
        )
    counts = [int(turn.get("output_tokens") or 0) for records in turns for turn in records]
    mask = np.frombuffer(b"".join(blob or b"" for blob in masks), blobs.MASK_DTYPE)
    per_token = np.repeat(np.array(call_codes, np.int16), counts)
    codes = np.full(len(mask), -1, np.int16)
    if np.count_nonzero(mask) == len(per_token):
        codes[mask.view(np.bool_)] = per_token
    else:  # a damaged record somewhere: episode by episode, so that it spoils only its own
        start = 0
        for blob, records in zip(masks, turns, strict=True):
            own, names = token_version_codes(np.frombuffer(blob or b"", blobs.MASK_DTYPE), records)
            remap = np.array([versions[name] for name in names] + [-1], np.int16)
            codes[start : start + len(own)] = remap[own]
            start += len(own)
    lengths = [len(blob or b"") // blobs.MASK_BYTES for blob in masks]
    # The validity bitmap packed by numpy: pa.array(mask=...) takes 10x as long.
    valid = np.packbits(codes >= 0, bitorder="little")
    indices = pa.Array.from_buffers(pa.int16(), len(codes), [pa.py_buffer(valid), pa.py_buffer(codes)])
    values = pa.DictionaryArray.from_arrays(indices, pa.array(list(versions), pa.string()))
    return pa.ListArray.from_arrays(pa.array([0, *accumulate(lengths)], pa.int32()), values)


def arrow_record_batch(columns: EpisodeColumns) -> pa.Buffer:
    """Some episodes as Arrow IPC messages of ARROW_SCHEMA: their dictionary batch and their record
    batch (each chunk replaces the dictionary of token_weight_versions, as the stream format
    allows). The token arrays go from the stored blobs into list columns with one copy, the JSON
    text goes as stored."""
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
        _token_versions_column(columns.loss_mask, turns),
        pa.array(
            [[(turn.get("finish_reason") or {}).get("type") for turn in rows] for rows in turns],
            pa.list_(pa.string()),
        ),
        pa.array(columns.error, pa.string()),
        pa.array([_json_text(text) for text in columns.messages_json], pa.string()),
        pa.array([_json_text(text) for text in columns.info_json], pa.string()),
        pa.array(columns.segment, pa.int32()),
        pa.array(columns.segments, pa.int32()),
    ]
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, ARROW_SCHEMA) as writer:
        writer.write_batch(pa.RecordBatch.from_arrays(arrays, schema=ARROW_SCHEMA))
    stream = sink.getvalue()  # the schema message, ours, then ours, then the end marker
    head, tail = len(ARROW_SCHEMA_MESSAGE), len(ARROW_STREAM_END)
    return stream.slice(head, stream.size - head - tail)


class BatchStreamResponse(StreamingResponse):
    """A batch streamed from `rows`: `head`, then each chunk of episodes encoded by `encode` (joined
    by `separator`), then `tail`; in a pipeline: while one chunk is sent, the next ones are encoded
    (on threads: the event loop runs the episodes meanwhile) and read. Chunked, since its length is
    known only at the end, so an error once the status line went out can only cut the body short:
    the client sees it incomplete (no Arrow end marker, unterminated JSON).

    It owns `rows`: the read snapshot is closed however the response ends (sent, the client gone,
    an error)."""

    def __init__(
        self,
        rows: EpisodeRows,
        chunks: AsyncIterator[Any],
        encode: Callable[[Any], bytes | pa.Buffer],
        *,
        head: bytes,
        tail: bytes,
        separator: bytes = b"",
        media_type: str,
    ) -> None:
        self._rows = rows
        self._reader: asyncio.Task[None] | None = None
        self._stream = self._body(chunks, encode, head, tail, separator)
        super().__init__(self._stream, media_type=media_type)

    @staticmethod
    async def _read(
        chunks: AsyncIterator[Any],
        encode: Callable[[Any], bytes | pa.Buffer],
        encoded: asyncio.Queue[asyncio.Future[bytes | pa.Buffer] | None],
    ) -> None:
        try:
            async for chunk in chunks:
                await encoded.put(asyncio.ensure_future(asyncio.to_thread(encode, chunk)))
        except Exception as error:  # the database's: the body raises it where this chunk goes
            failed: asyncio.Future[bytes | pa.Buffer] = asyncio.get_running_loop().create_future()
            failed.set_exception(error)
            await encoded.put(failed)
        else:
            await encoded.put(None)

    async def _body(
        self,
        chunks: AsyncIterator[Any],
        encode: Callable[[Any], bytes | pa.Buffer],
        head: bytes,
        tail: bytes,
        separator: bytes,
    ) -> AsyncGenerator[bytes | memoryview]:
        encoded: asyncio.Queue[asyncio.Future[bytes | pa.Buffer] | None] = asyncio.Queue(PREFETCH_CHUNKS)
        self._reader = asyncio.create_task(self._read(chunks, encode, encoded))
        yield head
        first = True
        while (encoding := await encoded.get()) is not None:
            view = memoryview(await encoding)
            if not first and separator:
                yield separator
            first = False
            for start in range(0, len(view), SEND_BYTES):
                yield view[start : start + SEND_BYTES]
        yield tail

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


def arrow_stream(rows: EpisodeRows) -> BatchStreamResponse:
    """The episodes as an Arrow IPC stream: the schema message, a record batch per chunk, the end marker."""
    return BatchStreamResponse(
        rows,
        rows.chunks(),
        arrow_record_batch,
        head=ARROW_SCHEMA_MESSAGE,
        tail=ARROW_STREAM_END,
        media_type=ARROW_STREAM_MEDIA_TYPE,
    )


def tokens_json_stream(rows: BatchRows) -> BatchStreamResponse:
    """The batch as JSON (BatchOut) with its episodes' token arrays (EpisodeWithTokens)."""
    head, tail = batch_json_head(rows.head)
    return BatchStreamResponse(
        rows,
        rows.chunks(),
        episodes_with_tokens_json,
        head=head,
        tail=tail,
        separator=b",",
        media_type="application/json",
    )
