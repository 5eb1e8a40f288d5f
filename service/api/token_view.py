"""An episode's tokens as text, for people to read (GET /episodes/{id}/tokens, the viewer's token
view): decoded on the server with the service's own tokenizer, once per distinct token id."""

from __future__ import annotations

import numpy as np

from service.api.schemas import EpisodeTokenView, TokenTurnOut
from service.api.token_calls import call_spans
from service.loop.tokens import TokenTexts
from service.storage.models import Episode


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
