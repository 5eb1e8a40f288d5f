"""One stored episode as GET /episodes/{id} answers it: its summary, its token arrays, the weight
version of each response token, its transcript, and an external agent's earlier segments."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from service.api.schemas import EpisodeDetail, SegmentOut
from service.api.token_calls import token_version_codes
from service.records import TRAINABLE_STATUSES, EpisodeStatus, EpisodeTokens, TurnRecord
from service.storage.models import Episode, EpisodeSegment


def _arrays(tokens: EpisodeTokens | None) -> dict[str, Any]:
    """The token arrays by field name (the lists themselves, not copies); None each when absent."""
    return {
        field.name: None if tokens is None else getattr(tokens, field.name) for field in fields(EpisodeTokens)
    }


def segment_out(segment: EpisodeSegment) -> SegmentOut:
    return SegmentOut(
        segment=segment.segment, **_arrays(segment.tokens()), turns=segment.turns, messages=segment.messages
    )


def episode_detail(episode: Episode, earlier: Sequence[EpisodeSegment] = ()) -> EpisodeDetail:
    tokens = episode.tokens()
    turns = [TurnRecord(**turn) for turn in episode.turns or []]
    token_versions = None
    if tokens is not None:
        codes, versions = token_version_codes([episode.loss_mask], [episode.turns or []])
        names: list[str | None] = [*versions, None]  # code -1 reads the last: None
        token_versions = [names[code] for code in codes.tolist()]
    return EpisodeDetail(
        id=episode.id,
        status=EpisodeStatus(episode.status),
        reward=episode.reward,
        group_index=episode.group_index,
        sample_index=episode.sample_index,
        task_index=episode.task_index,
        attempt=episode.attempt,
        num_turns=episode.num_turns,
        prompt_length=None if tokens is None else len(tokens.prompt_ids),
        response_length=None if tokens is None else len(tokens.response_ids),
        error=episode.error,
        trainable=episode.status in TRAINABLE_STATUSES,
        **_arrays(tokens),
        weight_versions=[turn.weight_version for turn in turns],
        logprobs_modes=[turn.logprobs_mode for turn in turns],
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
