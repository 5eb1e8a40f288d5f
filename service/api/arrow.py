"""Episodes as the trainer's Arrow record batches: one row per episode (per segment of an external
agent's episode), the token arrays going from the stored little-endian blobs into list columns with
one concatenation and an offsets array, never through Python lists of numbers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import accumulate
from typing import Any

import numpy as np
import orjson
import pyarrow as pa

from service.api.token_calls import token_version_codes
from service.records import TRAINABLE_STATUSES
from service.storage import blobs
from service.storage.batch_rows import EpisodeColumns

ARROW_STREAM_MEDIA_TYPE = "application/vnd.apache.arrow.stream"

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
        ("logprobs_modes", pa.list_(pa.string())),  # per call: "processed", "raw" or null (unknown)
        ("error", pa.string()),
        ("messages_json", pa.string()),
        ("info_json", pa.string()),
        # An external agent's episode may have several segments, a row each (service/agents).
        ("segment", pa.int32()),
        ("segments", pa.int32()),
        # Train on it (completed or truncated); false: drop or mask it (failed, aborted, cancelled).
        ("trainable", pa.bool_()),
    ],
    metadata={"format": "rollout-service episodes v1"},
)

# The stream is the schema's IPC message, a record batch message per chunk, and this end marker
# (a continuation token and a zero length): Arrow's IPC streaming format.
ARROW_STREAM_END = b"\xff\xff\xff\xff\x00\x00\x00\x00"
ARROW_SCHEMA_MESSAGE = ARROW_SCHEMA.serialize().to_pybytes()


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
    per response token, null where not sampled."""
    codes, versions = token_version_codes(masks, turns, np.int16)
    lengths = [len(blob or b"") // blobs.MASK_BYTES for blob in masks]
    # The validity bitmap packed by numpy: pa.array(mask=...) takes 10x as long.
    valid = np.packbits(codes >= 0, bitorder="little")
    indices = pa.Array.from_buffers(pa.int16(), len(codes), [pa.py_buffer(valid), pa.py_buffer(codes)])
    values = pa.DictionaryArray.from_arrays(indices, pa.array(versions, pa.string()))
    return pa.ListArray.from_arrays(pa.array([0, *accumulate(lengths)], pa.int32()), values)


def _record_batch(columns: Mapping[str, Any]) -> pa.RecordBatch:
    """ARROW_SCHEMA's record batch of `columns` by field name (arrays, or values of the field's type)."""
    if columns.keys() != set(ARROW_SCHEMA.names):
        missing, extra = set(ARROW_SCHEMA.names) - columns.keys(), columns.keys() - set(ARROW_SCHEMA.names)
        raise ValueError(
            f"columns do not match ARROW_SCHEMA: missing {sorted(missing)}, extra {sorted(extra)}"
        )
    return pa.RecordBatch.from_pydict(dict(columns), schema=ARROW_SCHEMA)


def arrow_record_batch(columns: EpisodeColumns) -> pa.Buffer:
    """Some episodes as Arrow IPC messages of ARROW_SCHEMA: their dictionary batch and their record
    batch (each chunk replaces the dictionary of token_weight_versions, as the stream format
    allows). The token arrays go from the stored blobs into list columns with one copy, the JSON
    text goes as stored."""
    turns = [(orjson.loads(text) if text is not None else None) or [] for text in columns.turns_json]
    batch = _record_batch(
        {
            "episode_id": columns.episode_id,
            "batch_id": columns.batch_id,
            "group_index": columns.group_index,
            "sample_index": columns.sample_index,
            "task_index": columns.task_index,
            "status": columns.status,
            "reward": columns.reward,
            "attempt": columns.attempt,
            "num_turns": columns.num_turns,
            "prompt_ids": _list_column(columns.prompt_ids, pa.int32(), blobs.ID_BYTES),
            "response_ids": _list_column(columns.response_ids, pa.int32(), blobs.ID_BYTES),
            "loss_mask": _list_column(columns.loss_mask, pa.uint8(), blobs.MASK_BYTES),
            "rollout_logprobs": _list_column(columns.rollout_logprobs, pa.float64(), blobs.LOGPROB_BYTES),
            "weight_versions": [[turn.get("weight_version") for turn in rows] for rows in turns],
            "token_weight_versions": _token_versions_column(columns.loss_mask, turns),
            "finish_reasons": [
                [(turn.get("finish_reason") or {}).get("type") for turn in rows] for rows in turns
            ],
            "logprobs_modes": [[turn.get("logprobs_mode") for turn in rows] for rows in turns],
            "error": columns.error,
            "messages_json": [_json_text(text) for text in columns.messages_json],
            "info_json": [_json_text(text) for text in columns.info_json],
            "segment": columns.segment,
            "segments": columns.segments,
            "trainable": [status in TRAINABLE_STATUSES for status in columns.status],
        }
    )
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, ARROW_SCHEMA) as writer:
        writer.write_batch(batch)
    stream = sink.getvalue()  # the schema message, ours, then ours, then the end marker
    head, tail = len(ARROW_SCHEMA_MESSAGE), len(ARROW_STREAM_END)
    return stream.slice(head, stream.size - head - tail)
