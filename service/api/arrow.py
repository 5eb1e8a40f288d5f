"""The trainer's bulk format: a batch's episodes as one Arrow IPC stream.

Token arrays go from the stored little-endian blobs straight into Arrow list columns (one
concatenation and an offsets array), never through Python lists of numbers.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from itertools import accumulate

import pyarrow as pa

from service.storage import blobs
from service.storage.models import Episode

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


def episodes_to_arrow(episodes: Sequence[Episode]) -> bytes:
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
