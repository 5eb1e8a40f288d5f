"""Which generate call sampled each response token, derived once (`by_sampled_token`) from what an
episode stores: its loss mask and its calls' records (`turns`, each with `output_tokens` and
`weight_version`). The sampled (mask-1) tokens are, in order, the calls' outputs in order. From it:
each token's weight version (the episode's detail, the Arrow pull) and each call's span (the token
view)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from service.storage import blobs

IntArray = np.ndarray[Any, np.dtype[np.signedinteger[Any]]]


def by_sampled_token(
    call_values: IntArray, loss_mask: np.ndarray[Any, Any], output_tokens: Sequence[int]
) -> IntArray:
    """Each response token's call's value (`call_values`, one per call, e.g. its index), -1 where
    not sampled (mask 0). A damaged record, whose counts do not add up to the mask's ones, gives
    its calls the sampled tokens there are, in order, and leaves the rest -1."""
    per_token = np.repeat(call_values, output_tokens)
    sampled = np.asarray(loss_mask) != 0
    values = np.full(len(sampled), -1, call_values.dtype)
    if np.count_nonzero(sampled) == len(per_token):
        values[sampled] = per_token
    else:  # a damaged record
        positions = np.flatnonzero(sampled)
        count = min(len(positions), len(per_token))
        values[positions[:count]] = per_token[:count]
    return values


def _output_tokens(turns: Sequence[dict[str, Any]]) -> list[int]:
    return [int(turn.get("output_tokens") or 0) for turn in turns]


def token_version_codes(
    loss_masks: Sequence[np.ndarray[Any, Any] | bytes | None],
    turns: Sequence[Sequence[dict[str, Any]]],
    dtype: type[np.signedinteger[Any]] = np.int32,
) -> tuple[IntArray, list[str]]:
    """The weight version of each response token of some episodes (their masks concatenated), as
    codes (of `dtype`) into the returned versions; -1 where not sampled or SGLang reported none.
    A damaged record spoils only its own episode's codes. Raises ValueError when `dtype` cannot
    number the versions."""
    masks = [
        np.frombuffer(mask or b"", blobs.MASK_DTYPE) if mask is None or isinstance(mask, bytes) else mask
        for mask in loss_masks
    ]
    versions: dict[str, int] = {}
    call_codes = [
        [
            -1
            if (version := turn.get("weight_version")) is None
            else versions.setdefault(version, len(versions))
            for turn in records
        ]
        for records in turns
    ]
    if len(versions) > np.iinfo(dtype).max:
        raise ValueError(f"{len(versions)} weight versions: more than {np.dtype(dtype).name} codes number")
    counts = [_output_tokens(records) for records in turns]
    if not masks:
        return np.empty(0, dtype), []
    mask = np.concatenate(masks) if len(masks) > 1 else masks[0]
    if np.count_nonzero(mask) == sum(map(sum, counts)):  # every record whole: all episodes at once
        every_call = np.array([code for codes in call_codes for code in codes], dtype)
        every_count = [count for episode in counts for count in episode]
        return by_sampled_token(every_call, mask, every_count), list(versions)
    parts = [
        by_sampled_token(np.array(codes, dtype), episode_mask, episode_counts)
        for episode_mask, codes, episode_counts in zip(masks, call_codes, counts, strict=True)
    ]
    return np.concatenate(parts), list(versions)


def call_spans(loss_mask: np.ndarray[Any, Any], turns: Sequence[dict[str, Any]]) -> list[tuple[int, int]]:
    """Where each generate call's sampled tokens lie in the response, [start, end). A call that
    sampled nothing (or none of whose tokens a damaged record left) has an empty span where the
    call before it ended."""
    calls = by_sampled_token(np.arange(len(turns), dtype=np.int32), loss_mask, _output_tokens(turns))
    positions = np.flatnonzero(calls >= 0)
    owners = calls[positions]  # ascending: the calls' outputs are in order
    indices = np.arange(len(turns))
    firsts = np.searchsorted(owners, indices, "left")
    lasts = np.searchsorted(owners, indices, "right")
    spans: list[tuple[int, int]] = []
    for first, last in zip(firsts.tolist(), lasts.tolist(), strict=True):
        if last > first:
            spans.append((int(positions[first]), int(positions[last - 1]) + 1))
        else:
            at = spans[-1][1] if spans else 0
            spans.append((at, at))
    return spans
