"""AReaL's rollout workflow (rollout_client.areal) against a live service and the simulated SGLang
worker, on SQLite and PostgreSQL. AReaL itself is the stand-in under tests/areal_standin (following
AReaL at 4aef98d8d818af55b43621aaadba047ae10f4e77): the trainer's rollout resolves the workflow
from its import path, runs each prompt's `n_samples` calls of `arun_episode` at once
(GroupedRolloutWorkflow), checks and concatenates the trajectories; the test checks what AReaL
receives, row by row, against the episodes as the service stored them."""

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
from tests.support.service_process import episodes_running, generation_held, wait_for
from tests.support.trainer_service import stored_episodes

sys.path.insert(0, str(Path(__file__).parent / "areal_standin"))

from areal.api.cli_args import GenerationHyperparameters
from areal.infra.remote_inf_engine import RemoteInfEngine
from rollout_client import areal as adapter
from rollout_client.steps import digest

pytest_plugins = ("tests.support.trainer_fixtures",)
PINNED_AREAL = "4aef98d8d818af55b43621aaadba047ae10f4e77"
WORKFLOW = "tests.test_areal_adapter.NumpyWorkflow"  # the adapter's class, numpy for torch


class NumpyWorkflow(adapter.RolloutServiceWorkflow):  # type: ignore[misc,name-defined]
    tensor = staticmethod(np.asarray)  # the stand-in's trajectories hold numpy for torch


def rollout(
    engine: RemoteInfEngine, data: list[dict[str, Any]], n: int, **kwargs: Any
) -> list[dict[str, Any]]:
    """The trainer's rollout, as PPOTrainer.train runs it: the workflow by its import path."""
    gconfig = GenerationHyperparameters(n_samples=n, max_new_tokens=1024, temperature=0.9)
    return engine.rollout_batch(data, WORKFLOW, {"gconfig": gconfig, **kwargs}, group_size=n)


async def stored_by_batch(db: Database, url: str) -> dict[str, list[dict[str, Any]]]:
    """Every stored episode, by batch, in sample order."""
    async with db.sessionmaker() as session:
        rows = (
            await session.execute(select(Episode.id, Episode.batch_id).order_by(Episode.sample_index))
        ).all()
    episodes = await stored_episodes(url, [row.id for row in rows])
    batches: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        batches.setdefault(row.batch_id, []).append(episodes[row.id])
    return batches


def assert_rows_are_the_episodes(
    trajectory: dict[str, Any], episodes: list[dict[str, Any]], version: int, cap: int | None = None
) -> None:
    """One prompt's trajectory: its trained episodes in sample order, exactly the stored tokens."""
    trained = [e for e in episodes if e["status"] in ("completed", "truncated")]
    assert len(trajectory["input_ids"]) == len(trained)
    width = trajectory["input_ids"].shape[1]
    for row, episode in enumerate(trained):
        prompt, response = episode["prompt_ids"], episode["response_ids"]
        kept = len(response) if cap is None else min(len(response), cap)
        length = len(prompt) + kept
        pad = [0] * (width - length)
        assert trajectory["input_ids"][row].tolist() == prompt + response[:kept] + pad
        assert trajectory["attention_mask"][row].tolist() == [True] * length + [False] * len(pad)
        mask = episode["loss_mask"][:kept]
        assert trajectory["loss_mask"][row].tolist() == [0] * len(prompt) + mask + pad
        logps = [0.0] * len(prompt) + episode["rollout_logprobs"][:kept] + pad
        assert np.allclose(trajectory["logprobs"][row], logps)
        versions = [
            int(v) if v is not None and m else -1
            for v, m in zip(episode["token_weight_versions"][:kept], mask, strict=True)
        ]
        assert trajectory["versions"][row].tolist() == [-1] * len(prompt) + versions + pad
        assert set(versions) <= {-1, version}
        assert trajectory["rewards"][row] == pytest.approx(episode["reward"] or 0.0)


async def test_an_areal_rollout_gets_exactly_the_stored_groups(
    service: tuple[str, SimWorker], db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    url, worker = service
    monkeypatch.setenv("ROLLOUT_RUN_ID", "areal-test")
    worker.update_weights("7", abort_all=False)
    engine = RemoteInfEngine()
    engine.set_version(7)
    tasks = [4, 1, 1, 9, 0]  # a task twice: two prompts, two groups
    data = [{"task_index": task, "messages": [{"role": "user", "content": "unused"}]} for task in tasks]
    trajectories = await asyncio.to_thread(rollout, engine, data, 4)

    batches = await stored_by_batch(db, url)
    # The step's calls are one service batch, its id from the run, the version and the groups' tasks.
    step_id = f"areal-test-v7-n4-{digest([tasks, 4])}-0"
    assert set(batches) == {step_id}
    groups: dict[int, list[dict[str, Any]]] = {}
    for episode in batches[step_id]:
        groups.setdefault(episode["group_index"], []).append(episode)
    assert sorted(groups) == [0, 1, 2, 3, 4]
    kept = [
        group
        for group in sorted(groups)
        if any(e["status"] in ("completed", "truncated") for e in groups[group])
    ]
    assert len(trajectories) == len(kept)  # a group with no trained episode is rejected whole
    for trajectory, group in zip(trajectories, kept, strict=True):
        episodes = groups[group]
        assert {e["task_index"] for e in episodes} == {tasks[group]}  # the prompts' order
        assert [e["sample_index"] for e in episodes] == [0, 1, 2, 3]
        assert_rows_are_the_episodes(trajectory, episodes, 7)
        assert 7 in trajectory["versions"]
    statuses = [e["status"] for episodes in batches.values() for e in episodes]
    untrained = [s for s in statuses if s not in ("completed", "truncated")]
    assert untrained, "the simulated worker's mistakes should abort some episodes"
    assert sum(len(t["input_ids"]) for t in trajectories) == len(statuses) - len(untrained)
    episode = batches[step_id][0]
    assert (
        episode["sampling_params"]["temperature"] == 0.9
        and episode["sampling_params"]["max_new_tokens"] == 1024
    )

    # The same version again (a restarted trainer with its run id): the same batch, no new episodes.
    again = await asyncio.to_thread(rollout, engine, data, 4)
    assert [t["input_ids"].tolist() for t in again] == [t["input_ids"].tolist() for t in trajectories]
    async with db.sessionmaker() as session:
        assert set(await session.scalars(select(Batch.id))) == {step_id}
        assert len(list(await session.scalars(select(Episode.id)))) == 20


async def test_an_areal_response_over_the_cap_is_cut_and_a_lone_sample_is_its_own_group(
    service: tuple[str, SimWorker], db: Database
) -> None:
    url, _ = service
    engine = RemoteInfEngine()
    data = [{"messages": [{"role": "user", "content": str(task)}]} for task in (2, 5, 8, 11)]
    trajectories = await asyncio.to_thread(rollout, engine, data, 1, max_response_tokens=120)
    batches = await stored_by_batch(db, url)
    (episodes,) = batches.values()  # one batch of four groups of one
    assert len(episodes) == 4 and {e["group_index"] for e in episodes} == {0, 1, 2, 3}
    by_task = {episode["task_index"]: [episode] for episode in episodes}
    trained = [t for t in (2, 5, 8, 11) if by_task[t][0]["status"] in ("completed", "truncated")]
    assert len(trajectories) == len(trained)
    for trajectory, task in zip(trajectories, trained, strict=True):
        episode = by_task[task][0]
        kept = min(len(episode["response_ids"]), 120)
        assert trajectory["input_ids"][0].tolist() == episode["prompt_ids"] + episode["response_ids"][:kept]
        assert (trajectory["versions"][0] == -1).all()  # SGLang's "default" is no integer version


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
async def test_a_cancelled_areal_rollout_cancels_its_group(
    service: tuple[str, SimWorker], db: Database
) -> None:
    workflow = NumpyWorkflow(GenerationHyperparameters())
    engine, data = RemoteInfEngine(), {"task_index": 3}
    async with generation_held(service[0]):
        started = asyncio.gather(
            *[workflow.arun_episode(engine, data) for _ in range(8)]
        )  # as GroupedRolloutWorkflow
        await episodes_running(db)
        started.cancel()
        with pytest.raises(asyncio.CancelledError):
            await started

    async def cancelled() -> bool:  # gather ends with its first cancelled call; the first call cancels
        async with db.sessionmaker() as session:
            return list(await session.scalars(select(Batch.cancelled_at))) != [None]

    await wait_for(cancelled, 10, "the group's batch cancelled")
    async with db.sessionmaker() as session:
        statuses = list(await session.scalars(select(Episode.status)))
    assert len(statuses) == 8 and "queued" not in statuses


def test_an_areal_data_item_must_name_a_task() -> None:
    assert adapter.task_of_data({"task_index": 3, "messages": "x"}) == 3
    assert adapter.task_of_data({"messages": [{"role": "user", "content": " 12\n"}]}) == 12
    with pytest.raises(ValueError, match="needs task_index"):
        adapter.task_of_data({"messages": [{"role": "user", "content": "Solve 2 + 2"}]})


def test_the_pinned_commit_is_the_adapters() -> None:
    assert adapter.AREAL_COMMIT == PINNED_AREAL
    assert PINNED_AREAL in (Path(__file__).parent / "areal_standin" / "README.md").read_text()
