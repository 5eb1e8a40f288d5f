"""SkyRL's generator (rollout_client.skyrl) against a live service and the simulated SGLang worker,
on SQLite and PostgreSQL. SkyRL itself is the stand-in under tests/skyrl_standin (following SkyRL
at a9564572eb8e91076be43c1bd5e4615e3de17265): the experiment class's get_generator gives the
trainer the service's generator, whose output the trainer validates and scores; the test checks
what SkyRL receives, row by row, against the episodes as the service stored them."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy import select

from service.sim.worker import SimWorker
from service.storage.db import Database
from service.storage.models import Batch, Episode
from tests.support.service_process import wait_for
from tests.support.trainer_service import batch_ids_of, stored_episodes

sys.path.insert(0, str(Path(__file__).parent / "skyrl_standin"))

from rollout_client import skyrl as adapter
from skyrl.train.generators.utils import prepare_generator_input

pytest_plugins = ("tests.support.trainer_fixtures",)
PINNED_SKYRL = "a9564572eb8e91076be43c1bd5e4615e3de17265"


def skyrl_cfg(n: int = 4, max_input_length: int = 8192, max_generate_length: int = 1024) -> SimpleNamespace:
    """SkyRL's config as its trainer reads it; sampling params as get_vllm_sampling_params makes them."""
    sampling = {
        "min_tokens": 1, "skip_special_tokens": True, "include_stop_str_in_output": True,
        "max_tokens": max_generate_length, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
        "logprobs": 0, "stop": None,
    }  # fmt: skip
    return SimpleNamespace(
        trainer=SimpleNamespace(project_name="shop", run_name="test"),
        generator=SimpleNamespace(
            n_samples_per_prompt=n, max_input_length=max_input_length, sampling_params=sampling
        ),
        environment=SimpleNamespace(env_class="shop"),
    )


def dataset_rows(tasks: list[int]) -> list[dict[str, Any]]:
    """SkyRL's PromptDataset rows: the prompt, env class, the other columns as env_extras, a uid."""
    return [
        {"prompt": [{"role": "user", "content": f"task {task}"}], "env_class": None,
         "env_extras": {"task_index": task}, "uid": f"uid-{i}"}
        for i, task in enumerate(tasks)
    ]  # fmt: skip


def assert_rows_are_the_episodes(
    output: dict[str, Any], episodes: dict[str, dict[str, Any]], cfg: Any
) -> None:
    for row, metrics in enumerate(output["env_metrics"]):
        episode = episodes[metrics["episode_id"]]
        prompt, response = episode["prompt_ids"], episode["response_ids"]
        cap = cfg.generator.max_input_length - len(prompt)
        kept = min(len(response), cap)
        trained = episode["status"] in ("completed", "truncated")
        assert output["prompt_token_ids"][row] == prompt
        assert output["response_ids"][row] == (response[:kept] or [0])
        assert output["loss_masks"][row] == ((episode["loss_mask"][:kept] if trained else [0] * kept) or [0])
        assert output["rollout_logprobs"][row] == pytest.approx(episode["rollout_logprobs"][:kept] or [0.0])
        assert sum(output["rewards"][row]) == pytest.approx(output["rewards"][row][-1])  # on the last token
        if trained:
            assert output["rewards"][row][-1] == pytest.approx(episode["reward"] or 0.0)
            assert output["stop_reasons"][row] in ("stop", "length")
        else:
            assert output["stop_reasons"][row] == episode["status"]
        assert metrics["weight_versions"] == episode["weight_versions"]
        assert metrics["response_cut"] == (len(response) > cap)


async def test_a_skyrl_step_gets_exactly_the_stored_groups(
    service: tuple[str, SimWorker], db: Database, tokenizer: Any
) -> None:
    url, _ = service
    cfg = skyrl_cfg(n=4)
    experiment = adapter.experiment_class()(cfg)
    trainer = experiment.get_trainer(tokenizer)
    trainer.global_step = 2
    tasks = [5, 5, 1, 11, 0]
    output, uids = await trainer.generation_step(dataset_rows(tasks))

    episode_ids = [metrics["episode_id"] for metrics in output["env_metrics"]]
    episodes = await stored_episodes(url, episode_ids)
    assert len(episodes) == len(uids) == 20
    for row in range(20):  # SkyRL's order: the input's, group by group, sample by sample
        episode = episodes[episode_ids[row]]
        assert episode["task_index"] == tasks[row // 4] and episode["sample_index"] == row % 4
        assert output["trajectory_ids"][row].instance_id == uids[row] == f"uid-{row // 4}"
    assert_rows_are_the_episodes(output, episodes, cfg)
    assert episodes[episode_ids[0]]["sampling_params"] == {
        "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "max_new_tokens": 1024,
        "skip_special_tokens": True,
    }  # fmt: skip

    untrained = [
        row for row in range(20) if episodes[episode_ids[row]]["status"] not in ("completed", "truncated")
    ]
    assert untrained, "the simulated worker's mistakes should abort some episodes"
    for row in untrained:  # no loss, and no pull on the group's baseline: advantage 0
        assert not any(output["loss_masks"][row]) and output["advantages"][row] == pytest.approx(
            0.0, abs=1e-6
        )
    assert trainer.all_metrics["rollout_service/masked"] == len(untrained)
    statuses = {episode["status"] for episode in episodes.values()}
    assert sum(trainer.all_metrics[f"rollout_service/{s}"] for s in statuses) == 20

    # The same step again (a restarted trainer): the same batch, the same episodes.
    again = adapter.experiment_class()(cfg).get_trainer(tokenizer)
    again.global_step = 2
    repeated, _ = await again.generation_step(dataset_rows(tasks))
    assert [metrics["episode_id"] for metrics in repeated["env_metrics"]] == episode_ids
    async with db.sessionmaker() as session:
        assert set(await session.scalars(select(Batch.id))) == batch_ids_of(episodes)
    assert all("-train-2-0-n4-" in batch_id for batch_id in batch_ids_of(episodes))


async def test_skyrl_eval_and_the_length_cap(service: tuple[str, SimWorker], tokenizer: Any) -> None:
    url, _ = service
    # Tasks 3, 8 and 13's prompts are 1,121-1,126 tokens; each episode's answers 48 to 1,300 more,
    # as the simulated worker plans them per episode. A cap of 1,300 cut none of the six once (CI,
    # a rerun): 1,150 cuts every episode with more than 24 tokens of answers.
    cfg = skyrl_cfg(n=2, max_input_length=1150)
    trainer = adapter.experiment_class()(cfg).get_trainer(tokenizer)
    output, _ = await trainer.generation_step(dataset_rows([3, 8, 13]), phase="eval")
    episode_ids = [metrics["episode_id"] for metrics in output["env_metrics"]]
    episodes = await stored_episodes(url, episode_ids)
    assert all("-eval-1-" in batch_id for batch_id in batch_ids_of(episodes))
    assert_rows_are_the_episodes(output, episodes, cfg)
    cap = cfg.generator.max_input_length
    cut = sum(len(e["response_ids"]) > cap - len(e["prompt_ids"]) for e in episodes.values())
    assert cut and trainer.all_metrics["rollout_service/cut"] == cut

    short = adapter.experiment_class()(skyrl_cfg(n=2, max_input_length=64)).get_trainer(tokenizer)
    with pytest.raises(ValueError, match="max_input_length=64"):
        await short.generation_step(dataset_rows([3]), phase="eval")


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
async def test_a_cancelled_skyrl_generate_cancels_its_batch(
    service: tuple[str, SimWorker], db: Database, tokenizer: Any
) -> None:
    trainer = adapter.experiment_class()(skyrl_cfg(n=8)).get_trainer(tokenizer)
    step = asyncio.create_task(trainer.generation_step(dataset_rows(list(range(20)))))

    async def submitted() -> bool:
        async with db.sessionmaker() as session:
            return len(list(await session.scalars(select(Episode.id)))) == 160

    await wait_for(submitted, 10, "the step's batch")
    step.cancel()
    with pytest.raises(asyncio.CancelledError):
        await step
    async with db.sessionmaker() as session:
        [cancelled_at] = list(await session.scalars(select(Batch.cancelled_at)))
    assert cancelled_at is not None


def test_a_skyrl_row_must_name_a_task() -> None:
    assert adapter.task_of_row([{"role": "user", "content": "x"}], {"task_index": 4}) == 4
    assert adapter.task_of_row([{"role": "user", "content": " 9"}], None) == 9
    with pytest.raises(ValueError, match="task_index"):
        adapter.task_of_row([{"role": "user", "content": "Solve 2 + 2"}], {})
    generator_input, _ = prepare_generator_input(dataset_rows([1, 1]), 2, {}, "shop", "train", 0)
    generator = adapter.RolloutServiceGenerator(
        skyrl_cfg(), SimpleNamespace(pad_token_id=0), service=adapter.ServiceConfig("http://x", "e")
    )
    assert generator.groups_of(generator_input) == [(0, 2, 1), (2, 2, 1)]


def test_the_skyrl_adapter_says_which_settings_are_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROLLOUT_SERVICE_URL", raising=False)
    monkeypatch.delenv("ROLLOUT_ENV", raising=False)
    with pytest.raises(RuntimeError, match=r"rollout_client\.skyrl needs .*ROLLOUT_SERVICE_URL, ROLLOUT_ENV"):
        adapter.RolloutServiceGenerator(skyrl_cfg(), SimpleNamespace(pad_token_id=0))


def test_the_pinned_commit_is_the_adapters() -> None:
    assert adapter.SKYRL_COMMIT == PINNED_SKYRL
    assert PINNED_SKYRL in (Path(__file__).parent / "skyrl_standin" / "README.md").read_text()
