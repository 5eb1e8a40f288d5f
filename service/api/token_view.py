"""An episode's tokens as text, for people to read (GET /episodes/{id}/tokens, the viewer's token
view): decoded on the server with the service's own tokenizer, once per distinct token id."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from typing import Any

import numpy as np

from service.api.schemas import EpisodeTokenView, TokenTurnOut
from service.loop.tokens import TokenTexts
from service.storage.models import Episode


def call_spans(loss_mask: np.ndarray[Any, Any], turns: Sequence[dict[str, Any]]) -> list[tuple[int, int]]:
    """Where each generate call's sampled tokens lie in the response, [start, end): its tokens are
    the next `output_tokens` of the mask-1 tokens, in order (see presenters.token_version_codes).
    A call that sampled nothing has an empty span where the next one starts."""
    sampled = np.flatnonzero(loss_mask)
    counts = [int(turn.get("output_tokens") or 0) for turn in turns]
    spans: list[tuple[int, int]] = []
    for count, end in zip(counts, accumulate(counts), strict=True):
        if count and end <= len(sampled):
            spans.append((int(sampled[end - count]), int(sampled[end - 1]) + 1))
        else:  # nothing sampled, or a damaged record: an empty span after the previous call
            at = spans[-1][1] if spans else 0
            spans.append((at, at))
    return spans


async def episode_token_view(episode: Episode, texts: TokenTexts) -> EpisodeTokenView | None:
    """None when the episode stored no tokens (unfinished, or failed before its first prompt)."""
    tokens = episode.tokens()
    if tokens is None:
        return None
    turns = episode.turns or []
    response_tokens = await texts.texts(tokens.response_ids)
    prompt_text = await texts.whole(tokens.prompt_ids)
    return EpisodeTokenView(
        episode_id=episode.id,
        prompt_text=prompt_text,
        response_ids=tokens.response_ids,
        response_tokens=response_tokens,
        loss_mask=tokens.loss_mask,
        rollout_logprobs=tokens.rollout_logprobs,
        turns=[
            TokenTurnOut(
                turn=turn["turn"],
                resume=turn.get("resume", 0),
                weight_version=turn.get("weight_version"),
                start=start,
                end=end,
                engine_seconds=turn.get("engine_seconds", 0.0),
                env_seconds=turn.get("env_seconds", 0.0),
            )
            for turn, (start, end) in zip(turns, call_spans(np.array(tokens.loss_mask), turns), strict=True)
        ],
    )
