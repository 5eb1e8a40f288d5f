"""Which generate call sampled each response token, derived once (`sampling_calls`) from what an
episode stores: its loss mask and its calls' records (`turns`, each with `output_tokens` and
`weight_version`). The sampled (mask-1) tokens are, in order, the calls' outputs in order. From it:
each token's weight version (the episode's detail, the Arrow pull) and each call's span (the token
view)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from service.storage import blobs

IntArray = np.ndarray[Any, np.dtype[np.int32]]


def sampling_calls(loss_mask: np.ndarray[Any, Any], output_tokens: Sequence[int]) -> IntArray:
    """The index of the call that sampled each response token; -1 where not sampled (mask 0). A
    damaged record, whose counts do not add up to the mask's ones, gives its calls the sampled
    tokens there are, in order, and leaves the rest -1."""
    per_token = np.repeat(np.arange(len(output_tokens), dtype=np.int32), output_tokens)
    sampled = np.asarray(loss_mask) != 0
    calls = np.full(len(sampled), -1, np.int32)
    if np.count_nonzero(sampled) == len(per_token):
        calls[sampled] = per_token
    else:  # a damaged record
        positions = np.flatnonzero(sampled)
        count = min(len(positions), len(per_token))
        calls[positions[:count]] = per_token[:count]
    return calls


def _output_tokens(turns: Sequence[dict[str, Any]]) -> list[int]:
    return [int(turn.get("output_tokens") or 0) for turn in turns]


def token_version_codes(
    loss_masks: Sequence[np.ndarray[Any, Any] | bytes | None], turns: Sequence[Sequence[dict[str, Any]]]
) -> tuple[IntArray, list[str]]:
    """The weight version of each response token of some episodes (their masks concatenated), as
    codes into the returned versions; -1 where not sampled or SGLang reported none. A damaged
    record spoils only its own episode's codes."""
    masks = [
        np.frombuffer(mask or b"", blobs.MASK_DTYPE) if mask is None or isinstance(mask, bytes) else mask
        for mask in loss_masks
    ]
    if not masks:
        return np.empty(0, np.int32), []
    versions: dict[str, int] = {}
    call_codes = [
        -1 if (version := turn.get("weight_version")) is None else versions.setdefault(version, len(versions))
        for records in turns
        for turn in records
    ]
    counts = [_output_tokens(records) for records in turns]
    mask = np.concatenate(masks) if len(masks) > 1 else masks[0]
    if np.count_nonzero(mask) == sum(map(sum, counts)):  # every record whole: all episodes at once
        calls = sampling_calls(mask, [count for episode in counts for count in episode])
    else:  # episode by episode, each episode's calls numbered on from the one before
        parts, offset = [], 0
        for episode_mask, episode_counts in zip(masks, counts, strict=True):
            own = sampling_calls(episode_mask, episode_counts)
            parts.append(np.where(own >= 0, own + offset, -1).astype(np.int32))
            offset += len(episode_counts)
        calls = np.concatenate(parts)
    # Index -1 (not sampled) reads the appended -1.
    return np.array([*call_codes, -1], np.int32)[calls], list(versions)


def call_spans(loss_mask: np.ndarray[Any, Any], turns: Sequence[dict[str, Any]]) -> list[tuple[int, int]]:
    """Where each generate call's sampled tokens lie in the response, [start, end). A call that
    sampled nothing (or none of whose tokens a damaged record left) has an empty span where the
    call before it ended."""
    calls = sampling_calls(loss_mask, _output_tokens(turns))
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
