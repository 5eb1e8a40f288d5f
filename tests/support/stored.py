"""Finished batches written straight into the database, at sizes no test should wait for the loop to
make (a 2,000-episode batch, a 30,000-token episode), consistent as the loop stores them: each
call's `output_tokens` are its run of mask-1 tokens, ids within the test tokenizer's vocabulary."""

from __future__ import annotations

import random
import uuid

from service.records import EpisodeRequest, EpisodeResult, EpisodeStatus, EpisodeTokens, TurnRecord
from service.storage.batches import NewBatch, NewEpisode, enqueue_batch
from service.storage.db import Database
from service.storage.queue import claim_episodes, finish_episode

VOCABULARY = 4096  # the test tokenizer's ordinary tokens
CLAIM_AT_ONCE = 500


def synthetic_result(rng: random.Random, tokens: int, turns: int) -> EpisodeResult:
    """`turns` calls, each sampling a run of tokens followed by a run of context tokens."""
    per_turn = max(2, tokens // turns)
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    records = []
    for turn in range(turns):
        sampled = per_turn // 2
        context = per_turn - sampled if turn < turns - 1 else 0
        ids += [rng.randrange(VOCABULARY) for _ in range(sampled + context)]
        mask += [1] * sampled + [0] * context
        logprobs += [-rng.expovariate(2.0) for _ in range(sampled)] + [0.0] * context
        records.append(
            TurnRecord(turn, f"{turn // 4}", {"type": "stop"}, sampled, rng.random(), rng.random() / 5)
        )
    return EpisodeResult(
        status=EpisodeStatus.COMPLETED if rng.random() < 0.8 else EpisodeStatus.TRUNCATED,
        reward=float(rng.random() < 0.5),
        tokens=EpisodeTokens([rng.randrange(VOCABULARY) for _ in range(200)], ids, mask, logprobs),
        messages=[{"role": "user", "content": "a synthetic episode"}],
        info={},
        turns=records,
    )


async def store_finished_batch(
    db: Database, groups: int, samples: int, *, tokens: int = 200, turns: int = 4, seed: int = 0
) -> tuple[str, list[str]]:
    """A finished batch of groups x samples synthetic episodes; returns its id and episode ids."""
    rng = random.Random(seed)
    batch_id = f"stored-{uuid.uuid4().hex[:8]}"
    async with db.sessionmaker.begin() as session:
        await enqueue_batch(
            session,
            NewBatch(
                batch_id=batch_id,
                request_hash="s" * 64,
                env="builtin/shop",
                task_split="test",
                metadata={},
                episodes=[
                    NewEpisode(group, sample, EpisodeRequest("builtin/shop", "test", group % 40, {}, 30))
                    for group in range(groups)
                    for sample in range(samples)
                ],
            ),
        )
    episode_ids = []
    while claims := await claim_episodes(db.sessionmaker, "stored", CLAIM_AT_ONCE, 600):
        for claim in claims:
            outcome = synthetic_result(rng, tokens, turns)
            assert await finish_episode(db.sessionmaker, "stored", claim.id, claim.attempt, outcome)
            episode_ids.append(claim.id)
    return batch_id, episode_ids
