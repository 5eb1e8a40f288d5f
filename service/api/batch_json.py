"""Batches and groups as JSON: the batch's head (BatchOut up to its episodes), its episodes'
summaries (kept between polls: a complete group never changes) and, for `include_tokens=true`, its
episodes with their token arrays. Summaries are read with SQL labelled as EpisodeSummary's fields
(storage/batch_rows.SUMMARY_SELECTED), so a row is a summary as it is."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import numpy as np
import orjson
from sqlalchemy import Row, select

from service.api.schemas import BatchGroupOut, BatchOut, EpisodeSummary, GroupsOut, RewardStatsOut
from service.records import FINISHED_STATUSES, TRAINABLE_STATUSES
from service.shared import GroupSummaries
from service.storage import blobs
from service.storage.batch_rows import SUMMARY_SELECTED, BatchHead, BatchRows, EpisodeColumns
from service.storage.groups import GroupPage, RewardStats

if list(select(*SUMMARY_SELECTED).selected_columns.keys()) != list(EpisodeSummary.model_fields):
    raise AssertionError("SUMMARY_SELECTED's labels must be EpisodeSummary's fields, in order")


def summary_item(row: Row[Any]) -> dict[str, Any]:
    """An EpisodeSummary from a SUMMARY_SELECTED row (labelled as its fields)."""
    return row._asdict()


def batch_json_head(head: BatchHead, waiting_for_engine: str | None = None) -> tuple[bytes, bytes]:
    """A batch's JSON body (BatchOut) up to its episodes list, and what closes it: the episodes are
    streamed in between, a chunk at a time. `waiting_for_engine`: why its episodes wait, if they do."""
    counts = head.counts
    total = sum(counts.values())
    stats = head.group_stats
    finished = sum(counts[status] for status in FINISHED_STATUSES)
    body = BatchOut(
        **head.batch,
        counts=counts,
        total=total,
        finished=finished,
        complete=finished == total,
        groups_complete=head.groups_complete,
        groups_total=head.groups_total,
        groups_filtered=sum(1 for group in stats.values() if not group.std),
        groups=[
            BatchGroupOut(group_index=group, reward=RewardStatsOut(**asdict(stats[group]))) for group in stats
        ],
        waiting_for_engine=waiting_for_engine if finished < total else None,
        episodes=[],
    )
    text = body.model_dump_json().encode()
    assert text.endswith(b'"episodes":[]}'), "the episodes must be BatchOut's last field"
    return text.removesuffix(b"]}"), b"]}"


def groups_page_json(page: GroupPage, episodes: Sequence[Row[Any]]) -> bytes:
    """A page of GET /groups (GroupsOut): its groups with their episodes' summaries (SUMMARY_SELECTED
    rows with batch_id, by group in the page's order, then sample)."""
    items: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in episodes:
        item = summary_item(row)
        items.setdefault((item.pop("batch_id"), item["group_index"]), []).append(item)
    groups = []
    for group in page.groups:
        members = items.get((group.batch_id, group.group_index), [])
        groups.append(
            {
                "cursor": group.seq,
                "batch_id": group.batch_id,
                "group_index": group.group_index,
                "env": group.env,
                "task_index": group.task_index,
                "completed_at": group.completed_at,
                "reward": asdict(RewardStats.stored(group)),
                "cancelled": any(item["status"] == "cancelled" for item in members),
                "trainable": sum(1 for item in members if item["trainable"]),
                "episodes": members,
            }
        )
    body = GroupsOut.model_validate({"groups": groups, "next": page.next, "filtered": page.filtered})
    return body.model_dump_json().encode()


def group_summaries_json(rows: Sequence[Row[Any]]) -> dict[int, bytes]:
    """Whole groups' episode summaries (SUMMARY_SELECTED rows, by group then sample) as JSON list
    items, by group index."""
    items: dict[int, list[bytes]] = {}
    for row in rows:
        items.setdefault(row.group_index, []).append(orjson.dumps(summary_item(row)))
    return {group: b",".join(texts) for group, texts in items.items()}


async def batch_summary_json(
    rows: BatchRows, summaries: GroupSummaries, waiting_for_engine: str | None = None
) -> bytes:
    """The batch as JSON (BatchOut) with its complete groups' summaries: those of earlier polls from
    `summaries`, the others read from `rows` and added to it while the batch has groups to come."""
    head, tail = batch_json_head(rows.head, waiting_for_engine)
    batch_id, complete = rows.head.batch_id, rows.head.complete_groups
    whole = rows.head.groups_complete == rows.head.groups_total
    groups = summaries.of(batch_id)
    missing = [group for group in complete if group not in groups]
    async for chunk in rows.summaries(missing):
        encoded = await asyncio.to_thread(group_summaries_json, chunk)
        if not whole:
            summaries.add(batch_id, encoded)
        groups.update(encoded)
    if whole:
        summaries.forget(batch_id)
    return head + b",".join(groups[group] for group in complete) + tail


def _numbers(blob: bytes | None, dtype: str) -> np.ndarray[Any, Any] | None:
    return None if blob is None else np.frombuffer(blob, dtype=dtype)


def _length(blob: bytes | None) -> int | None:
    return None if blob is None else len(blob) // blobs.ID_BYTES


def episodes_with_tokens_json(columns: EpisodeColumns) -> bytes:
    """Some episodes (EpisodeWithTokens) as JSON list items: the token arrays from the stored blobs
    through numpy into orjson, never a Python number per token."""
    items = []
    for index in range(len(columns)):
        prompt, response = columns.prompt_ids[index], columns.response_ids[index]
        text = columns.turns_json[index]
        turns = (orjson.loads(text) if text is not None else None) or []
        item = {
            "id": columns.episode_id[index],
            "status": columns.status[index],
            "reward": columns.reward[index],
            "group_index": columns.group_index[index],
            "sample_index": columns.sample_index[index],
            "task_index": columns.task_index[index],
            "attempt": columns.attempt[index],
            "num_turns": columns.num_turns[index],
            "prompt_length": _length(prompt),
            "response_length": _length(response),
            "error": columns.error[index],
            "trainable": columns.status[index] in TRAINABLE_STATUSES,
            "prompt_ids": _numbers(prompt, blobs.ID_DTYPE),
            "response_ids": _numbers(response, blobs.ID_DTYPE),
            "loss_mask": _numbers(columns.loss_mask[index], blobs.MASK_DTYPE),
            "rollout_logprobs": _numbers(columns.rollout_logprobs[index], blobs.LOGPROB_DTYPE),
            "weight_versions": [turn.get("weight_version") for turn in turns],
            "logprobs_modes": [turn.get("logprobs_mode") for turn in turns],
            "segment": columns.segment[index],
            "segments": columns.segments[index],
        }
        items.append(orjson.dumps(item, option=orjson.OPT_SERIALIZE_NUMPY))
    return b",".join(items)
