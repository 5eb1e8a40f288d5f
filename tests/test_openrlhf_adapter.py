"""OpenRLHF's agent executor (rollout_client.openrlhf) against a live service and the simulated
SGLang worker, on SQLite and PostgreSQL. OpenRLHF itself is the stand-in under
tests/openrlhf_standin (following OpenRLHF at 3c3be6234e0cb353e76bb8019947db9dfe99fca7): a rollout
actor loads examples/openrlhf/agent_func.py as `--train.agent_func_path` does, runs each prompt's
samples as concurrent `execute` calls, and the samples generator turns each result into an
Experience; the test checks the Experiences against the episodes as the service stored them."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy import select

from service.sim.worker import SimWorker
from service.storage.db import Database
from service.storage.models import Batch
from tests.support.service_process import episodes_running, generation_held, wait_for
from tests.support.trainer_service import batch_ids_of, stored_episodes

sys.path.insert(0, str(Path(__file__).parent / "openrlhf_standin"))

from openrlhf.trainer.ppo_utils.samples_generator import SamplingParams, _process_response_into_experience
from openrlhf.trainer.ray.vllm_engine import RolloutRayActor
from rollout_client import openrlhf as adapter

pytest_plugins = ("tests.support.trainer_fixtures",)
PINNED_OPENRLHF = "3c3be6234e0cb353e76bb8019947db9dfe99fca7"
AGENT_FILE = Path(__file__).parents[1] / "examples" / "openrlhf" / "agent_func.py"


async def generate(
    actor: RolloutRayActor, tokenizer: Any, prompts: list[tuple[str, str]], n: int, max_len: int
) -> list[list[dict[str, Any]]]:
    """SamplesGenerator's dispatch: every prompt to the actor at once, `n` samples each (each Ray
    call gets its own copy of the sampling params)."""

    def params() -> SamplingParams:
        return SamplingParams(temperature=0.9, top_p=1.0, top_k=-1, max_tokens=1024, logprobs=1)

    return list(
        await asyncio.gather(*[
            actor.generate_responses(prompt, label, params(), max_len, tokenizer, num_samples=n)
            for prompt, label in prompts
        ])
    )  # fmt: skip


def assert_experience_is_the_episode(
    response: dict[str, Any], episode: dict[str, Any], reward: float, max_len: int
) -> None:
    experience = _process_response_into_experience(response, max_len)
    prompt, stored = episode["prompt_ids"], episode["response_ids"]
    kept = min(len(stored), max_len - len(prompt))
    trained = episode["status"] in ("completed", "truncated")
    tokens = prompt + (stored[:kept] or [0])  # nothing sampled: one masked pad token
    assert experience.sequences[0].tolist() == tokens
    mask = [0] * len(prompt) + ((episode["loss_mask"][:kept] if trained else [0] * kept) or [0])
    assert experience.action_mask[0].tolist() == mask[1:]  # OpenRLHF's mask is shifted by one
    logprobs = [0.0] * len(prompt) + (episode["rollout_logprobs"][:kept] or [0.0])
    assert np.allclose(experience.rollout_log_probs[0], logprobs[1:])
    assert experience.rewards[0] == pytest.approx(reward) and experience.scores[0] == pytest.approx(reward)
    assert experience.info["rollout_service_masked"][0] == (not trained)
    assert experience.info["rollout_service_cut"][0] == (len(stored) > kept)
    assert experience.truncated[0] == (episode["status"] == "truncated" or len(stored) > kept)


async def test_openrlhf_samples_are_exactly_the_stored_groups(
    service: tuple[str, SimWorker], db: Database, tokenizer: Any
) -> None:
    url, _ = service
    actor = RolloutRayActor(str(AGENT_FILE))  # as --train.agent_func_path loads it
    prompts = [("Find my order", "4"), ("Find my order", "1"), ("9", None), ("Find my order", "4")]
    results = await generate(actor, tokenizer, prompts, 4, 16384)
    ids = [response["episode_id"] for responses in results for response in responses]
    episodes = await stored_episodes(url, ids)
    assert len(episodes) == 16  # the same prompt twice: two groups
    untrained = 0
    for position, ((_, label), responses) in enumerate(zip(prompts, results, strict=True)):
        group = [episodes[response["episode_id"]] for response in responses]
        assert {e["task_index"] for e in group} == {int(label or 9)}
        assert {e["group_index"] for e in group} == {position}  # the prompts' dispatch order
        assert [e["sample_index"] for e in group] == [0, 1, 2, 3]
        trained = [e["reward"] or 0.0 for e in group if e["status"] in ("completed", "truncated")]
        for response, episode in zip(responses, group, strict=True):
            ok = episode["status"] in ("completed", "truncated")
            untrained += not ok
            reward = (episode["reward"] or 0.0) if ok else (sum(trained) / len(trained) if trained else 0.0)
            assert_experience_is_the_episode(response, episode, reward, 16384)
    assert untrained, "the simulated worker's mistakes should abort some episodes"
    assert len(batch_ids_of(episodes)) == 1  # the prompts dispatched together: one service batch
    episode = episodes[ids[0]]
    assert (
        episode["sampling_params"]["temperature"] == 0.9
        and episode["sampling_params"]["max_new_tokens"] == 1024
    )


async def test_an_openrlhf_response_over_max_len_is_cut_and_counted(
    service: tuple[str, SimWorker], db: Database, tokenizer: Any
) -> None:
    url, _ = service
    actor = RolloutRayActor(str(AGENT_FILE))
    results = await generate(actor, tokenizer, [(str(task), str(task)) for task in (2, 5, 8)], 2, 1300)
    episodes = await stored_episodes(url, [r["episode_id"] for responses in results for r in responses])
    cut = 0
    for responses in results:
        group = [episodes[response["episode_id"]] for response in responses]
        trained = [e["reward"] or 0.0 for e in group if e["status"] in ("completed", "truncated")]
        for response, episode in zip(responses, group, strict=True):
            ok = episode["status"] in ("completed", "truncated")
            reward = (episode["reward"] or 0.0) if ok else (sum(trained) / len(trained) if trained else 0.0)
            assert_experience_is_the_episode(response, episode, reward, 1300)
            cut += len(episode["prompt_ids"]) + len(episode["response_ids"]) > 1300
    assert cut and actor.executor.counts.cut == cut  # type: ignore[attr-defined]


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
async def test_a_cancelled_openrlhf_prompt_cancels_its_group(
    service: tuple[str, SimWorker], db: Database, tokenizer: Any
) -> None:
    actor = RolloutRayActor(str(AGENT_FILE))
    async with generation_held(service[0]):
        started = asyncio.ensure_future(generate(actor, tokenizer, [("3", "3")], 8, 16384))
        await episodes_running(db)
        started.cancel()
        with pytest.raises(asyncio.CancelledError):
            await started

    async def cancelled() -> bool:
        async with db.sessionmaker() as session:
            return list(await session.scalars(select(Batch.cancelled_at))) != [None]

    await wait_for(cancelled, 10, "the group's batch cancelled")


def test_an_openrlhf_sample_must_name_a_task() -> None:
    assert adapter.task_of("Find my order", " 12\n") == 12
    assert adapter.task_of("7", None) == 7
    with pytest.raises(ValueError, match="must be a task index"):
        adapter.task_of("Solve 2 + 2", "4 apples")
    assert adapter.action_ranges(np.array([1, 1, 0, 0, 1, 0, 1], np.uint8), 10) == [
        (10, 12),
        (14, 15),
        (16, 17),
    ]


def test_the_pinned_commit_is_the_adapters() -> None:
    assert adapter.OPENRLHF_COMMIT == PINNED_OPENRLHF
    assert PINNED_OPENRLHF in (Path(__file__).parent / "openrlhf_standin" / "README.md").read_text()
