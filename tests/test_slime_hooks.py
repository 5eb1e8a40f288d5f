"""slime's two hooks (rollout_client.slime) against a live service and the simulated SGLang worker,
on SQLite and PostgreSQL. slime itself is the stand-in under tests/slime_standin (see its README):
the hooks must fill slime's Sample exactly as the service stored the episode, apply slime's dynamic
filter as slime does, and leave no work behind when slime cancels."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from service.app import create_app
from service.config import TEST_TOKENIZER_DIR
from service.serving import serve_app
from service.sim.policy import SimConfig
from service.sim.worker import SimWorker, create_sim_app, serve_in_thread
from service.storage.db import Database
from service.storage.models import Batch, Episode
from tests.conftest import service_settings
from tests.support.service_process import episodes_of, wait_for
from tests.support.tokenizer import fresh_test_tokenizer

sys.path.insert(0, str(Path(__file__).parent / "slime_standin"))

from rollout_client import slime as hooks
from rollout_client.steps import ServiceConfig
from slime.rollout.data_source import RolloutDataSource
from slime.utils.types import Sample

FILTER = "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"


def slime_args(**overrides: Any) -> SimpleNamespace:
    """The slime flags the hooks read, as in slime's tau-bench example (smaller)."""
    values: dict[str, Any] = {
        "rollout_temperature": 1.0,
        "rollout_top_p": 1.0,
        "rollout_top_k": -1,
        "rollout_max_response_len": 200,
        "rollout_stop": None,
        "rollout_stop_token_ids": None,
        "rollout_skip_special_tokens": False,
        "rollout_batch_size": 3,
        "n_samples_per_prompt": 2,
        "over_sampling_batch_size": 4,
        "dynamic_sampling_filter_path": FILTER,
        "reward_key": None,
        "hf_checkpoint": str(TEST_TOKENIZER_DIR),
        "save": "/checkpoints/test-run",
        "rollout_seed": 42,
    }
    values.update(overrides)
    return SimpleNamespace(**values)


@pytest.fixture
async def service(
    database_url: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[str, SimWorker]]:
    latency = getattr(request, "param", 0.01)
    worker = SimWorker(SimConfig(latency_seconds=latency))
    with serve_in_thread(create_sim_app(worker.config, worker=worker)) as sglang_url:
        async with serve_app(create_app(service_settings(database_url, sglang_url))) as url:
            monkeypatch.setenv("ROLLOUT_SERVICE_URL", url)
            monkeypatch.setenv("ROLLOUT_ENV", "builtin/shop")
            monkeypatch.setenv("ROLLOUT_TASK_SPLIT", "test")
            monkeypatch.setenv("ROLLOUT_MAX_TURNS", "10")
            monkeypatch.delenv("ROLLOUT_RUN_ID", raising=False)
            yield url, worker
            # The hooks keep one client per event loop (slime runs them on one loop for its whole
            # process); each test has a loop of its own, closed after it, so the test's client is
            # closed first: its connections were left open in the closed loop, for the garbage
            # collector to find (ResourceWarning) during a later test.
            config = ServiceConfig.from_env(adapter="slime")
            await hooks._async_client(asyncio.get_running_loop(), config.url, config.api_key).close()
            hooks._async_client.cache_clear()


@pytest.fixture(scope="module")
def tokenizer() -> Iterator[Any]:
    yield fresh_test_tokenizer()


async def stored_episode(url: str, episode_id: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        response = await http.get(f"/episodes/{episode_id}")
    assert response.status_code == 200, response.text
    episode: dict[str, Any] = response.json()
    return episode


def assert_sample_is_the_episode(sample: Sample, episode: dict[str, Any], tokenizer: Any) -> None:
    """What slime trains on is exactly what the service stored."""
    response = episode["response_ids"]
    assert sample.tokens == episode["prompt_ids"] + response
    assert (
        sample.response_length
        == len(response)
        == len(sample.loss_mask or [])
        == len(sample.rollout_log_probs or [])
    )
    assert sample.loss_mask == episode["loss_mask"]
    assert sample.rollout_log_probs == episode["rollout_logprobs"]
    assert sample.reward == (episode["reward"] or 0.0)
    assert sample.status == Sample.Status[hooks.STATUS_NAMES[episode["status"]]]
    assert sample.weight_versions == [version or "" for version in episode["weight_versions"]]
    assert len(sample.weight_versions) == episode["num_turns"]
    assert sample.response == tokenizer.decode(response, skip_special_tokens=False)
    assert sample.metadata["episode_id"] == episode["id"]
    assert sample.metadata["num_turns"] == episode["num_turns"]
    assert sample.metadata["info"] == episode["info"]


async def test_generate_fills_the_sample_as_slime_does(
    service: tuple[str, SimWorker], tokenizer: Any
) -> None:
    url, _ = service
    args = slime_args()
    samples = [Sample(index=i, prompt=str(task), metadata={"keep": 1}) for i, task in enumerate([0, 3, 7])]
    samples.append(Sample(index=3, prompt="ignored", metadata={"task_index": 5, "keep": 1}))
    filled = await asyncio.gather(*(hooks.generate(args, s, hooks.sampling_params_of(args)) for s in samples))
    for sample, task in zip(filled, [0, 3, 7, 5], strict=True):
        episode = await stored_episode(url, sample.metadata["episode_id"])
        assert episode["task_index"] == task and sample.metadata["keep"] == 1
        assert_sample_is_the_episode(sample, episode, tokenizer)
        # slime's sampling params went through unchanged (nulls left out)
        assert episode["sampling_params"] == {
            "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 200,
            "skip_special_tokens": False, "no_stop_trim": True, "spaces_between_special_tokens": False,
        }  # fmt: skip


@pytest.mark.parametrize("answer_held", [False, True], ids=["waiting", "answer-in-flight"])
@pytest.mark.parametrize("service", [0.5], indirect=True)  # slow turns: cancelled mid-episode
async def test_a_cancelled_generate_cancels_its_episode(
    service: tuple[str, SimWorker], db: Database, answer_held: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled while it waits for the episode, or while the POST's answer is still on its way
    (the service took the batch and started the episode, the hook has not heard yet): either way
    the episode ends cancelled and the engine does no more work for it."""
    _, sim = service
    submit = hooks.AsyncRolloutClient.submit
    cancelled = asyncio.Event()

    async def answered_late(self: hooks.AsyncRolloutClient, *args: Any, **kwargs: Any) -> Any:
        submission = await submit(self, *args, **kwargs)
        if answer_held:  # the answer reaches the hook only after slime cancelled it
            await cancelled.wait()
        return submission

    monkeypatch.setattr(hooks.AsyncRolloutClient, "submit", answered_late)
    args = slime_args()
    task = asyncio.create_task(
        hooks.generate(args, Sample(index=11, prompt="2"), hooks.sampling_params_of(args))
    )

    async def started() -> bool:
        async with db.sessionmaker() as session:
            statuses = await session.scalars(select(Episode.status))
            return "running" in set(statuses)

    await wait_for(started, 10, "the episode to start")
    task.cancel()
    cancelled.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    async with db.sessionmaker() as session:
        batch_ids = list(await session.scalars(select(Batch.id)))
    assert len(batch_ids) == 1 and "-sample-11-" in batch_ids[0]
    [episode] = await episodes_of(db, batch_ids[0])
    assert episode.status == "cancelled"
    await wait_for(lambda: _true(sim.running == 0), 5, "the engine to be idle")
    calls = sum(1 for r in sim.requests if r.rid.startswith(episode.id))
    await asyncio.sleep(1.0)
    assert sum(1 for r in sim.requests if r.rid.startswith(episode.id)) == calls  # no orphan work


def data_source(args: SimpleNamespace, tasks: range) -> RolloutDataSource:
    return RolloutDataSource(args, [Sample(prompt=str(task)) for task in tasks])


async def test_generate_rollout_returns_exactly_the_batch_size_of_filtered_groups(
    service: tuple[str, SimWorker], db: Database, tokenizer: Any
) -> None:
    url, _ = service
    args = slime_args()
    output = await asyncio.to_thread(hooks.generate_rollout, args, 7, data_source(args, range(40)))
    groups = output.samples
    assert len(groups) == args.rollout_batch_size
    assert all(len(group) == args.n_samples_per_prompt for group in groups)
    for group in groups:  # slime's filter held: no group whose rewards are all equal
        assert len({sample.reward for sample in group}) > 1
        assert len({sample.prompt for sample in group}) == 1
        for sample in group:
            episode = await stored_episode(url, sample.metadata["episode_id"])
            assert_sample_is_the_episode(sample, episode, tokenizer)
            assert episode["task_index"] == int(sample.prompt)
    assert [group[0].index for group in groups] == sorted(group[0].index for group in groups)
    dropped = sum(output.metrics.values())
    assert all(name.startswith("rollout/dynamic_filter/drop_zero_std_") for name in output.metrics)

    # Every batch of the step: nothing left running (the surplus was cancelled), and the groups
    # seen are the kept ones plus the dropped ones.
    async with db.sessionmaker() as session:
        batch_ids = sorted(await session.scalars(select(Batch.id)))
        statuses = list(await session.scalars(select(Episode.status)))
    assert all("-rollout-7-" in batch_id for batch_id in batch_ids)
    assert not {"queued", "running"} & set(statuses)
    assert len(statuses) == args.over_sampling_batch_size * len(batch_ids) * args.n_samples_per_prompt
    assert statuses.count("cancelled") + 2 * (dropped + len(groups)) <= len(statuses)

    # A restarted trainer asks for the same step again: the same batches, the same episodes.
    again = await asyncio.to_thread(hooks.generate_rollout, args, 7, data_source(args, range(40)))
    episode_ids = [[s.metadata["episode_id"] for s in group] for group in groups]
    assert [[s.metadata["episode_id"] for s in group] for group in again.samples] == episode_ids
    async with db.sessionmaker() as session:
        assert sorted(await session.scalars(select(Batch.id))) == batch_ids


async def test_generate_rollout_evaluation(service: tuple[str, SimWorker], tmp_path: Path) -> None:
    args = slime_args()
    path = tmp_path / "shop-dev.jsonl"
    path.write_text("".join(json.dumps({"index": task}) + "\n" for task in (1, 4, 9)))
    args.eval_datasets = [
        SimpleNamespace(
            name="shop dev", path=str(path), input_key="index", n_samples_per_eval_prompt=2,
            temperature=0.0, top_p=None, top_k=1, max_response_len=150,
        )
    ]  # fmt: skip
    output = await asyncio.to_thread(hooks.generate_rollout, args, 3, None, True)
    result = output.data["shop dev"]
    assert len(result["rewards"]) == len(result["truncated"]) == len(result["samples"]) == 6
    assert [int(sample.prompt) for sample in result["samples"]] == [1, 1, 4, 4, 9, 9]
    assert all(isinstance(reward, float) for reward in result["rewards"])
    url, _ = service
    episode = await stored_episode(url, result["samples"][0].metadata["episode_id"])
    assert episode["sampling_params"]["temperature"] == 0.0
    assert episode["sampling_params"]["max_new_tokens"] == 150


def test_the_hooks_say_which_settings_are_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROLLOUT_SERVICE_URL", raising=False)
    monkeypatch.delenv("ROLLOUT_ENV", raising=False)
    with pytest.raises(RuntimeError, match="ROLLOUT_SERVICE_URL, ROLLOUT_ENV"):
        hooks.generate_rollout(slime_args(), 0, None)


async def _true(value: bool) -> bool:
    return value
