"""verl's agent-loop manager (rollout_client.verl) against a live service and the simulated SGLang
worker, on SQLite and PostgreSQL. verl itself is the stand-in under tests/verl_standin (following
verl at b178a3cd56f58b2d502255daba591e92833930a7): RayPPOTrainer builds the manager from the one
config line and runs its step; the test checks what verl receives, row by row, against the
episodes as the service stored them."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy import select

from service.config import TEST_TOKENIZER_DIR
from service.sim.worker import SimWorker
from service.storage.db import Database
from service.storage.models import Batch, Episode
from tests.support.trainer_service import batch_ids_of, stored_episodes

sys.path.insert(0, str(Path(__file__).parent / "verl_standin"))

from rollout_client import RolloutClient
from rollout_client import verl as adapter
from verl.trainer.ppo.ray_trainer import RayPPOTrainer

pytest_plugins = ("tests.support.trainer_fixtures",)
PINNED_VERL = "b178a3cd56f58b2d502255daba591e92833930a7"
MANAGER = "tests.test_verl_adapter.NumpyManager"  # the adapter's class, numpy for torch (see README)
PAD = 0


class NumpyManager(adapter.RolloutServiceAgentLoopManager):
    tensor = staticmethod(np.asarray)


class Config(dict[str, Any]):
    """OmegaConf's DictConfig as verl reads it: attribute access and .get."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError as missing:
            raise AttributeError(name) from missing


def verl_config(n: int = 4, response_length: int = 4096, prompt_length: int = 2048) -> Config:
    def c(**values: Any) -> Config:
        return Config(values)

    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}
    return c(
        trainer=c(project_name="shop", experiment_name="test"),
        actor_rollout_ref=c(
            model=c(path=str(TEST_TOKENIZER_DIR)),
            rollout=c(
                n=n, prompt_length=prompt_length, response_length=response_length,
                calculate_log_probs=True, **sampling,
                val_kwargs=c(n=1, do_sample=False, temperature=0.0, top_p=1.0, top_k=-1),
                agent=c(agent_loop_manager_class=MANAGER),
            ),
        ),
    )  # fmt: skip


def dataloader_batch(tasks: list[int]) -> dict[str, Any]:
    """A batch of verl's RLHFDataset rows as its collate_fn makes them (what is not a tensor is an
    object array): extra_info.index is the task index."""
    extra = np.empty(len(tasks), dtype=object)
    extra[:] = [{"index": task, "split": "test"} for task in tasks]
    return {
        "dummy_tensor": np.zeros((len(tasks), 1), dtype=np.uint8),
        "raw_prompt": np.array([f"task {task}" for task in tasks], dtype=object),
        "index": np.array(tasks, dtype=object),
        "extra_info": extra,
        "data_source": np.array(["builtin/shop"] * len(tasks), dtype=object),
    }


def assert_rows_are_the_episodes(batch: Any, episodes: dict[str, dict[str, Any]], config: Config) -> None:
    """verl's tensors, row by row, hold exactly the stored tokens, padded as verl pads them."""
    plen = config.actor_rollout_ref.rollout.prompt_length
    rlen = config.actor_rollout_ref.rollout.response_length
    tensors, rows = batch.batch, len(batch)
    assert tensors["prompts"].shape == (rows, plen)
    for name in ("responses", "response_mask", "rollout_log_probs", "rm_scores"):
        assert tensors[name].shape == (rows, rlen), name
    assert tensors["input_ids"].shape == tensors["attention_mask"].shape == (rows, plen + rlen)
    for row in range(rows):
        episode = episodes[batch.non_tensor_batch["episode_id"][row]]
        prompt, response = episode["prompt_ids"], episode["response_ids"]
        kept = min(len(response), rlen)
        trained = episode["status"] in ("completed", "truncated")
        assert tensors["prompts"][row].tolist() == [PAD] * (plen - len(prompt)) + prompt
        assert tensors["responses"][row].tolist() == response[:kept] + [PAD] * (rlen - kept)
        mask = episode["loss_mask"][:kept] if trained else [0] * kept
        assert tensors["response_mask"][row].tolist() == mask + [0] * (rlen - kept)
        assert np.allclose(
            tensors["rollout_log_probs"][row], episode["rollout_logprobs"][:kept] + [0.0] * (rlen - kept)
        )
        attention = (
            [0] * (plen - len(prompt)) + [1] * (len(prompt) + max(kept, 1)) + [0] * (rlen - max(kept, 1))
        )
        assert tensors["attention_mask"][row].tolist() == attention
        assert (
            tensors["input_ids"][row].tolist()
            == tensors["prompts"][row].tolist() + tensors["responses"][row].tolist()
        )
        assert tensors["position_ids"][row].tolist() == np.clip(np.cumsum(attention) - 1, 0, None).tolist()
        scores = tensors["rm_scores"][row]
        assert (
            np.count_nonzero(scores[: max(kept, 1) - 1]) == 0
            and np.count_nonzero(scores[max(kept, 1) :]) == 0
        )
        if trained:
            assert scores[max(kept, 1) - 1] == pytest.approx(episode["reward"] or 0.0)
        assert batch.non_tensor_batch["__num_turns__"][row] == episode["num_turns"]
        assert batch.non_tensor_batch["weight_versions"][row] == episode["weight_versions"]
        assert bool(batch.non_tensor_batch["response_cut"][row]) == (len(response) > rlen)


async def test_a_verl_step_gets_exactly_the_stored_groups(
    service: tuple[str, SimWorker], db: Database
) -> None:
    url, _ = service
    config = verl_config(n=4)
    tasks = [3, 0, 7, 3, 12, 5]  # a task twice: two groups of one task stay apart
    trainer = RayPPOTrainer(config)
    trainer.init_workers()
    assert trainer.rollout_replicas == []
    batch, timing = await asyncio.to_thread(trainer.generation_step, dataloader_batch(tasks))

    assert len(batch) == len(tasks) * 4
    episodes = await stored_episodes(url, list(batch.non_tensor_batch["episode_id"]))
    assert len(episodes) == len(batch)  # every row its own episode
    # Rows in verl's order: the prompts repeated n times, interleaved; each group one task, by sample.
    for row in range(len(batch)):
        episode = episodes[batch.non_tensor_batch["episode_id"][row]]
        assert episode["task_index"] == tasks[row // 4] == batch.non_tensor_batch["extra_info"][row]["index"]
        assert episode["sample_index"] == row % 4
        assert len({batch.non_tensor_batch["uid"][r] for r in range(row - row % 4, row - row % 4 + 4)}) == 1
    assert_rows_are_the_episodes(batch, episodes, config)

    # Failed and aborted episodes are no samples with reward 0: no loss on them, and their group's
    # GRPO baseline is the trained episodes' mean.
    statuses = [episodes[e]["status"] for e in batch.non_tensor_batch["episode_id"]]
    untrained = [row for row, status in enumerate(statuses) if status not in ("completed", "truncated")]
    assert untrained, "the simulated worker's mistakes should abort some episodes"
    for row in untrained:
        assert not batch.batch["response_mask"][row].any() and not batch.batch["advantages"][row].any()
        group = range(row - row % 4, row - row % 4 + 4)
        trained = [
            episodes[batch.non_tensor_batch["episode_id"][r]]["reward"] or 0.0
            for r in group
            if r not in untrained
        ]
        if trained:
            assert batch.batch["rm_scores"][row].sum() == pytest.approx(np.mean(trained))
    metrics = batch.meta_info["rollout_service"]
    assert metrics["rollout_service/masked"] == len(untrained)
    assert sum(metrics[f"rollout_service/{s}"] for s in set(statuses)) == len(batch)
    assert metrics["rollout_service/groups_requests"] >= 1
    assert "agent_loop/rollout_service/seconds" in timing

    # A restarted trainer asks for the same step again: the same batch, the same episodes.
    again = RayPPOTrainer(config)
    again.init_workers()
    repeated, _ = await asyncio.to_thread(again.generation_step, dataloader_batch(tasks))
    assert list(repeated.non_tensor_batch["episode_id"]) == list(batch.non_tensor_batch["episode_id"])
    async with db.sessionmaker() as session:
        batch_ids = set(await session.scalars(select(Batch.id)))
    assert batch_ids == batch_ids_of(episodes) and len(batch_ids) == 1
    [batch_id] = batch_ids
    assert "-train-1-n4-" in batch_id


async def test_a_response_over_verls_length_is_cut_with_its_mask(service: tuple[str, SimWorker]) -> None:
    url, _ = service
    config = verl_config(n=2, response_length=160)
    trainer = RayPPOTrainer(config)
    trainer.init_workers()
    batch, _ = await asyncio.to_thread(trainer.generation_step, dataloader_batch([1, 2, 4, 6]))
    episodes = await stored_episodes(url, list(batch.non_tensor_batch["episode_id"]))
    assert all(e["sampling_params"]["max_new_tokens"] == 160 for e in episodes.values())
    assert_rows_are_the_episodes(batch, episodes, config)
    cut = sum(len(e["response_ids"]) > 160 for e in episodes.values())
    assert cut and batch.meta_info["rollout_service"]["rollout_service/cut"] == cut


async def test_verl_validation_pads_and_uses_the_eval_settings(service: tuple[str, SimWorker]) -> None:
    """verl's _validate pads its batch with copies of the first rows: groups of two sizes."""
    url, _ = service
    config = verl_config(n=1)
    manager = NumpyManager(config)
    from verl.protocol import DataProto

    rows = dataloader_batch([2, 9, 2])
    rows["uid"] = np.array(["a", "b", "a"], dtype=object)
    prompts = DataProto.from_single_dict(rows, meta_info={"validate": True, "global_steps": 5})
    output = await asyncio.to_thread(manager.generate_sequences, prompts)
    episodes = await stored_episodes(url, list(output.non_tensor_batch["episode_id"]))
    assert [episodes[e]["task_index"] for e in output.non_tensor_batch["episode_id"]] == [2, 9, 2]
    assert all(e["sampling_params"]["temperature"] == 0.0 for e in episodes.values())
    assert all("-val-5-" in batch_id for batch_id in batch_ids_of(episodes))
    assert_rows_are_the_episodes(output, episodes, config)


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
async def test_a_stopped_verl_step_cancels_its_batch(
    service: tuple[str, SimWorker], db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray cancels a step by raising KeyboardInterrupt in it: the service batch is cancelled."""
    groups = RolloutClient.groups

    def interrupted(self: RolloutClient, *args: Any, **kwargs: Any) -> Any:
        groups(self, *args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(RolloutClient, "groups", interrupted)
    trainer = RayPPOTrainer(verl_config(n=8))
    trainer.init_workers()
    with pytest.raises(KeyboardInterrupt):
        await asyncio.to_thread(trainer.generation_step, dataloader_batch(list(range(20))))
    async with db.sessionmaker() as session:
        statuses = list(await session.scalars(select(Episode.status)))
        [cancelled_at] = list(await session.scalars(select(Batch.cancelled_at)))
    assert cancelled_at is not None
    assert len(statuses) == 160 and not {"queued"} & set(statuses)


def test_a_prompt_longer_than_verls_prompt_length_is_refused() -> None:
    from rollout_client.batch import EpisodeArrays

    episode = EpisodeArrays.from_detail({
        "id": "e", "batch_id": "b", "group_index": 0, "sample_index": 0, "task_index": 0,
        "status": "completed", "reward": 1.0, "attempt": 0, "num_turns": 1,
        "prompt_ids": [1] * 10, "response_ids": [2, 3], "loss_mask": [1, 1],
        "rollout_logprobs": [-0.1, -0.2],
        "weight_versions": ["1"], "finish_reasons": [{"type": "stop"}], "error": None,
        "messages": [], "info": {},
    })  # fmt: skip
    shape = adapter.VerlShape(prompt_length=8, response_length=4, pad_token_id=0)
    with pytest.raises(ValueError, match="prompt_length=8"):
        adapter.build_arrays([episode], [1.0], shape, adapter.StepCounts())


def test_the_verl_adapter_says_which_settings_are_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROLLOUT_SERVICE_URL", raising=False)
    monkeypatch.delenv("ROLLOUT_ENV", raising=False)
    with pytest.raises(RuntimeError, match=r"rollout_client\.verl needs .*ROLLOUT_SERVICE_URL, ROLLOUT_ENV"):
        NumpyManager(verl_config())


def test_the_pinned_commit_is_the_adapters() -> None:
    assert adapter.VERL_COMMIT == PINNED_VERL
    assert PINNED_VERL in (Path(__file__).parent / "verl_standin" / "README.md").read_text()
