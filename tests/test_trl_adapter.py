"""TRL's rollout function (rollout_client.trl) against a live service and the simulated SGLang
worker, on SQLite and PostgreSQL. TRL itself is the stand-in under tests/trl_standin (following TRL
at f2cd57710ae345ea6428ae95363267fcf38a3dc8): GRPOTrainer calls the rollout function with its
repeated prompts and scores what comes back; the test checks what TRL receives, completion by
completion, against the episodes as the service stored them."""

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
from service.storage.models import Batch, Episode
from tests.support.trainer_service import batch_ids_of, stored_episodes

sys.path.insert(0, str(Path(__file__).parent / "trl_standin"))

from rollout_client import RolloutClient
from rollout_client import trl as adapter
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.grpo_trainer import repeat_sampler

pytest_plugins = ("tests.support.trainer_fixtures",)
PINNED_TRL = "f2cd57710ae345ea6428ae95363267fcf38a3dc8"


def trainer(tokenizer: Any, **config: Any) -> GRPOTrainer:
    """The one line of the README: the service's rollout function and its reward."""
    args = GRPOConfig(output_dir="/checkpoints/shop-grpo", **config)
    return GRPOTrainer(
        model="Qwen/Qwen3-4B",
        reward_funcs=adapter.service_reward,
        args=args,
        processing_class=tokenizer,
        rollout_func=adapter.ServiceRollout(),
    )


def assert_completions_are_the_episodes(
    scored: dict[str, Any], episodes: dict[str, dict[str, Any]], cap: int, pad: int
) -> None:
    inputs = scored["inputs"]
    for row, inp in enumerate(inputs):
        episode = episodes[inp["episode_id"]]
        prompt, response = episode["prompt_ids"], episode["response_ids"]
        kept = min(len(response), cap)
        trained = episode["status"] in ("completed", "truncated")
        width = scored["prompt_ids"].shape[1]
        assert scored["prompt_ids"][row].tolist() == [pad] * (width - len(prompt)) + prompt
        assert scored["prompt_mask"][row].tolist() == [0] * (width - len(prompt)) + [1] * len(prompt)
        shown = max(kept, 1)  # an episode that sampled nothing: one masked pad token
        ids = response[:kept] if kept else [pad]
        width = scored["completion_ids"].shape[1]
        assert scored["completion_ids"][row].tolist() == ids + [pad] * (width - shown)
        mask = (episode["loss_mask"][:kept] if trained else [0] * kept) or [0]
        assert scored["loss_mask"][row].tolist() == mask + [0] * (width - shown)
        logps = episode["rollout_logprobs"][:kept] if kept else [0.0]
        assert np.allclose(scored["sampling_per_token_logps"][row], logps + [0.0] * (width - shown))
        assert inp["episode_status"] == episode["status"] and inp["response_cut"] == (len(response) > cap)
        assert inp["weight_versions"] == episode["weight_versions"]
        if trained:
            assert scored["rewards"][row] == pytest.approx(episode["reward"] or 0.0)
        else:  # unscorable: out of the baseline, no advantage, no loss
            assert np.isnan(scored["rewards"][row]) and scored["advantages"][row] == 0.0
            assert not scored["loss_mask"][row].any()


async def test_a_trl_step_gets_exactly_the_stored_groups(
    service: tuple[str, SimWorker], db: Database, tokenizer: Any
) -> None:
    url, _ = service
    grpo = trainer(tokenizer, num_generations=4, max_completion_length=4096)
    grpo.state.global_step = 3
    tasks = [4, 1, 1, 9, 0, 6]  # a task twice in a row: two groups, not one of 8
    inputs = repeat_sampler([{"prompt": str(task), "answer": task} for task in tasks], 4)
    scored = await asyncio.to_thread(grpo._generate_and_score_completions, inputs)

    episode_ids = [inp["episode_id"] for inp in scored["inputs"]]
    episodes = await stored_episodes(url, episode_ids)
    assert len(episodes) == len(inputs) == 24
    for row, inp in enumerate(scored["inputs"]):  # TRL's order: group by group, sample by sample
        episode = episodes[inp["episode_id"]]
        assert episode["task_index"] == tasks[row // 4] == inp["answer"]
        assert episode["sample_index"] == row % 4
    assert len({episodes[e]["batch_id"] for e in episode_ids[8:16]}) == 1
    assert len({(episodes[e]["batch_id"], episodes[e]["group_index"]) for e in episode_ids[8:16]}) == 2
    assert_completions_are_the_episodes(scored, episodes, 4096, tokenizer.pad_token_id)

    statuses = [episodes[e]["status"] for e in episode_ids]
    untrained = [s for s in statuses if s not in ("completed", "truncated")]
    assert untrained, "the simulated worker's mistakes should abort some episodes"
    # The group baseline is the trained completions' mean: TRL's own reward arithmetic on them.
    for group in range(len(tasks)):
        rewards = scored["rewards"][group * 4 : group * 4 + 4]
        trained = rewards[~np.isnan(rewards)]
        if len(trained) > 1 and np.std(trained) > 0:
            expected = (trained - trained.mean()) / (np.std(trained, ddof=1) + 1e-4)
            assert np.allclose(scored["advantages"][group * 4 : group * 4 + 4][~np.isnan(rewards)], expected)
    logged = grpo._metrics["train"]
    assert logged["rollout_service/masked"] == [float(len(untrained))]
    assert sum(logged[f"rollout_service/{s}"][0] for s in set(statuses)) == len(inputs)
    episode = episodes[episode_ids[0]]
    assert episode["sampling_params"]["top_k"] == -1 and episode["sampling_params"]["max_new_tokens"] == 4096

    # The same step again (a restarted trainer): the same batch, the same episodes.
    again = trainer(tokenizer, num_generations=4, max_completion_length=4096)
    again.state.global_step = 3
    repeated = await asyncio.to_thread(again._generate_and_score_completions, repeat_sampler(
        [{"prompt": str(task), "answer": task} for task in tasks], 4
    ))  # fmt: skip
    assert [inp["episode_id"] for inp in repeated["inputs"]] == episode_ids
    async with db.sessionmaker() as session:
        assert set(await session.scalars(select(Batch.id))) == batch_ids_of(episodes)
    [batch_id] = batch_ids_of(episodes)
    assert "-train-3-p0-0-n4-" in batch_id


async def test_trl_eval_and_conversational_prompts_and_the_length_cap(
    service: tuple[str, SimWorker], tokenizer: Any
) -> None:
    url, _ = service
    grpo = trainer(tokenizer, num_generations=4, num_generations_eval=2, max_completion_length=150)
    grpo.model.training = False
    prompts = [[{"role": "user", "content": str(task)}] for task in (2, 5, 8)]
    scored = await asyncio.to_thread(
        grpo._generate_and_score_completions, repeat_sampler([{"prompt": p} for p in prompts], 2)
    )
    episode_ids = [inp["episode_id"] for inp in scored["inputs"]]
    episodes = await stored_episodes(url, episode_ids)
    assert [episodes[e]["task_index"] for e in episode_ids] == [2, 2, 5, 5, 8, 8]
    assert all("-eval-0-" in batch_id for batch_id in batch_ids_of(episodes))
    assert_completions_are_the_episodes(scored, episodes, 150, tokenizer.pad_token_id)
    cut = sum(len(e["response_ids"]) > 150 for e in episodes.values())
    assert cut and grpo._metrics["eval"]["rollout_service/cut"] == [float(cut)]
    assert scored["completion_ids"].shape[1] <= 150


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
async def test_a_stopped_trl_step_cancels_its_batch(
    service: tuple[str, SimWorker], db: Database, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    groups = RolloutClient.groups

    def interrupted(self: RolloutClient, *args: Any, **kwargs: Any) -> Any:
        groups(self, *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(RolloutClient, "groups", interrupted)
    grpo = trainer(tokenizer, num_generations=8)
    inputs = repeat_sampler([{"prompt": str(task)} for task in range(20)], 8)
    with pytest.raises(KeyboardInterrupt):
        await asyncio.to_thread(grpo._generate_and_score_completions, inputs)
    async with db.sessionmaker() as session:
        [cancelled_at] = list(await session.scalars(select(Batch.cancelled_at)))
        statuses = list(await session.scalars(select(Episode.status)))
    assert cancelled_at is not None and len(statuses) == 160 and "queued" not in statuses


def test_a_trl_prompt_must_name_a_task() -> None:
    assert adapter.task_of_prompt(" 12\n") == 12
    assert adapter.task_of_prompt([{"role": "system", "content": "x"}, {"role": "user", "content": "7"}]) == 7
    with pytest.raises(ValueError, match="must be a task index"):
        adapter.task_of_prompt("Solve 2 + 2")
    assert adapter.group_rows(["1", "1", "1", "2", "2"], 2) == [(0, 2, 1), (2, 1, 1), (3, 2, 2)]


def test_the_trl_adapter_says_which_settings_are_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROLLOUT_SERVICE_URL", raising=False)
    monkeypatch.delenv("ROLLOUT_ENV", raising=False)
    with pytest.raises(RuntimeError, match=r"rollout_client\.trl needs .*ROLLOUT_SERVICE_URL, ROLLOUT_ENV"):
        assert adapter.ServiceRollout().service


def test_the_pinned_commit_is_the_adapters() -> None:
    assert adapter.TRL_COMMIT == PINNED_TRL
    assert PINNED_TRL in (Path(__file__).parent / "trl_standin" / "README.md").read_text()
