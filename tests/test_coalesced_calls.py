"""A step's one-sample calls as one service batch (rollout_client.siblings), through the adapters of
the two trainers that ask per sample, AReaL and OpenRLHF (their stand-ins under tests/), against a
live service on SQLite and PostgreSQL: which calls share a batch, and what a cancelled call, a
group whose calls are all cancelled, and a batch cancelled in the service do to the others."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from service.sim.worker import SimWorker
from service.storage.db import Database
from service.storage.models import Batch, Episode
from tests.support.service_process import episodes_running, generation_held, wait_for
from tests.support.trainer_service import adapter_service, stored_episodes

sys.path.insert(0, str(Path(__file__).parent / "areal_standin"))
sys.path.insert(0, str(Path(__file__).parent / "openrlhf_standin"))

from areal.api.cli_args import GenerationHyperparameters
from areal.infra.remote_inf_engine import RemoteInfEngine
from openrlhf.trainer.ppo_utils.samples_generator import SamplingParams
from openrlhf.trainer.ray.vllm_engine import RolloutRayActor
from rollout_client import areal as areal_adapter
from rollout_client.errors import RequestError
from rollout_client.steps import ServiceConfig

from tests.test_areal_adapter import NumpyWorkflow, assert_rows_are_the_episodes
from tests.test_openrlhf_adapter import AGENT_FILE

pytest_plugins = ("tests.support.trainer_fixtures",)
TRAINED = ("completed", "truncated")


async def stored_batches(db: Database) -> dict[str, list[Episode]]:
    """Every stored episode, by batch, in group and sample order."""
    async with db.sessionmaker() as session:
        episodes = await session.scalars(
            select(Episode).order_by(Episode.batch_id, Episode.group_index, Episode.sample_index)
        )
        batches: dict[str, list[Episode]] = {}
        for episode in episodes:
            batches.setdefault(episode.batch_id, []).append(episode)
        return batches


def workflow(window: float) -> Any:
    return NumpyWorkflow(GenerationHyperparameters(max_new_tokens=1024), coalesce_seconds=window)


async def test_calls_within_the_window_share_a_batch_and_later_ones_do_not(
    service: tuple[str, SimWorker], db: Database
) -> None:
    service[1].update_weights("3", abort_all=False)
    flow, engine = workflow(1.0), RemoteInfEngine()
    engine.set_version(3)
    first, second, odd, late = ({"task_index": task} for task in (4, 7, 9, 2))
    calls = [flow.arun_episode(engine, first) for _ in range(2)]
    started = [asyncio.ensure_future(call) for call in calls]
    await asyncio.sleep(0.2)  # a prompt dispatched later, within the first call's window
    started += [asyncio.ensure_future(flow.arun_episode(engine, second)) for _ in range(2)]
    started += [asyncio.ensure_future(flow.arun_episode(engine, odd)) for _ in range(3)]  # n = 3
    rows = await asyncio.gather(*started)
    later = await asyncio.gather(*[flow.arun_episode(engine, late) for _ in range(2)])  # a new window

    batches = await stored_batches(db)
    shapes = {
        batch: [(e.group_index, e.sample_index, e.task_index) for e in episodes]
        for batch, episodes in batches.items()
    }
    assert sorted(shapes.values()) == sorted([
        [(0, 0, 4), (0, 1, 4), (1, 0, 7), (1, 1, 7)],  # one batch of the window's groups of two
        [(0, 0, 9), (0, 1, 9), (0, 2, 9)],  # a batch has one group size: its own
        [(0, 0, 2), (0, 1, 2)],  # after the window closed
    ])  # fmt: skip
    assert all(batch.startswith(f"{flow.run_id}-v3-") for batch in batches)
    assert flow._calls.batches_submitted == 3
    # Each call got its own row: its group's episode of its sample index, trained ones only.
    by_sample = {(e.task_index, e.sample_index): e for episodes in batches.values() for e in episodes}
    for call, row in enumerate([*rows, *later]):
        episode = by_sample[[(4, 0), (4, 1), (7, 0), (7, 1), (9, 0), (9, 1), (9, 2), (2, 0), (2, 1)][call]]
        assert (row is not None) == (episode.status in TRAINED)
        if row is not None:
            stored = (await stored_episodes(service[0], [episode.id]))[episode.id]
            assert_rows_are_the_episodes(row, [stored], 3)


async def test_a_cancelled_call_gives_up_only_its_row(service: tuple[str, SimWorker], db: Database) -> None:
    service[1].update_weights("0", abort_all=False)
    flow, engine = workflow(0.05), RemoteInfEngine()
    kept, dropped = {"task_index": 3}, {"task_index": 5}
    async with generation_held(service[0]):
        calls = [asyncio.ensure_future(flow.arun_episode(engine, kept)) for _ in range(4)]
        abandoned = [asyncio.ensure_future(flow.arun_episode(engine, dropped)) for _ in range(4)]
        await episodes_running(db)
        calls[0].cancel()  # one sample of a prompt (the call that opened the window)
        for call in abandoned:  # every sample of the other prompt: the batch still has callers
            call.cancel()
        await asyncio.gather(calls[0], *abandoned, return_exceptions=True)
        await asyncio.sleep(0.3)  # a cancel sent to the service would have landed
    rows = await asyncio.gather(*calls[1:])

    (episodes,) = (await stored_batches(db)).values()
    assert [(e.group_index, e.sample_index) for e in episodes] == [(g, s) for g in (0, 1) for s in range(4)]
    assert "cancelled" not in {e.status for e in episodes}  # the siblings' work went on
    async with db.sessionmaker() as session:
        assert list(await session.scalars(select(Batch.cancelled_at))) == [None]
    stored = await stored_episodes(service[0], [e.id for e in episodes])
    for row, sample in zip(rows, (1, 2, 3), strict=True):
        episode = stored[episodes[sample].id]
        assert (row is not None) == (episode["status"] in TRAINED)
        if row is not None:
            assert_rows_are_the_episodes(row, [episode], 0)
    assert flow.counts.abandoned == 5 and flow.counts.metrics()["rollout_service/abandoned"] == 5

    async def all_counted() -> bool:  # the abandoned group too, once its episodes end
        return sum(flow.counts.statuses.values()) == 8

    await wait_for(all_counted, 10, "every episode counted by its status")


async def test_calls_all_cancelled_in_their_window_submit_nothing(
    service: tuple[str, SimWorker], db: Database
) -> None:
    flow, engine = workflow(3.0), RemoteInfEngine()
    calls = [asyncio.ensure_future(flow.arun_episode(engine, {"task_index": 1})) for _ in range(3)]
    await asyncio.sleep(0)  # the calls join the window
    for call in calls:
        call.cancel()
    await asyncio.gather(*calls, return_exceptions=True)
    assert flow._calls._open is None  # the window is gone, its timer with it: nothing can submit
    await asyncio.sleep(0.3)
    assert await stored_batches(db) == {} and flow._calls.batches_submitted == 0
    assert flow.counts.abandoned == 3
    # The next calls open a window of their own.
    flow._calls.window = 0.02
    rows = await asyncio.gather(*[flow.arun_episode(engine, {"task_index": 1}) for _ in range(2)])
    (episodes,) = (await stored_batches(db)).values()
    assert len(episodes) == 2 and len(rows) == 2


async def test_an_openrlhf_step_cancelled_whole_cancels_its_batch(
    service: tuple[str, SimWorker], db: Database, tokenizer: Any
) -> None:
    actor = RolloutRayActor(str(AGENT_FILE))

    async def prompt(task: int) -> list[dict[str, Any]]:
        params = SamplingParams(max_tokens=1024, logprobs=1)
        return await actor.generate_responses(str(task), str(task), params, 16384, tokenizer, num_samples=4)

    async with generation_held(service[0]):
        step = asyncio.ensure_future(asyncio.gather(prompt(2), prompt(6)))
        await episodes_running(db)
        step.cancel()
        with pytest.raises(asyncio.CancelledError):
            await step

    async def cancelled() -> bool:
        async with db.sessionmaker() as session:
            return list(await session.scalars(select(Batch.cancelled_at))) != [None]

    await wait_for(cancelled, 10, "the step's batch cancelled")
    (episodes,) = (await stored_batches(db)).values()
    assert len(episodes) == 8  # both prompts, one batch
    assert actor.executor.counts.abandoned == 8  # type: ignore[attr-defined]


async def test_a_batch_cancelled_in_the_service_is_no_sample_with_reward_0(
    service: tuple[str, SimWorker], db: Database, tokenizer: Any
) -> None:
    """Someone else cancels the step's batch: OpenRLHF's rows are kept masked, AReaL's dropped."""
    url, _ = service
    actor, flow = RolloutRayActor(str(AGENT_FILE)), workflow(0.02)
    params = SamplingParams(max_tokens=1024, logprobs=1)
    async with generation_held(url):
        openrlhf = asyncio.ensure_future(
            actor.generate_responses("3", "3", params, 16384, tokenizer, num_samples=3)
        )

        async def areal_calls() -> list[Any]:
            engine = RemoteInfEngine()
            return list(
                await asyncio.gather(*[flow.arun_episode(engine, {"task_index": 3}) for _ in range(3)])
            )

        areal = asyncio.create_task(areal_calls())
        await episodes_running(db)
        await wait_for(lambda: _batches_at_least(db, 2), 10, "both batches submitted")
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            for batch_id in await stored_batches(db):
                assert (await http.post(f"/batches/{batch_id}/cancel")).status_code == 200
        responses, trajectories = await asyncio.wait_for(asyncio.gather(openrlhf, areal), 30)

    counts = actor.executor.counts  # type: ignore[attr-defined]
    assert [r["episode_status"] for r in responses] == ["cancelled"] * 3
    assert all(r["action_ranges"] == [] for r in responses)  # no loss on them
    assert all(r["extra_logs"]["rollout_service_masked"] == 1.0 for r in responses)
    assert counts.statuses == {"cancelled": 3} and counts.masked == 3
    assert trajectories == [None, None, None]  # AReaL leaves them out
    assert flow.counts.statuses == {"cancelled": 3} and flow.counts.dropped == 3


async def _batches_at_least(db: Database, count: int) -> bool:
    return len(await stored_batches(db)) >= count


def test_the_window_is_configurable_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    environ = {"ROLLOUT_SERVICE_URL": "http://x", "ROLLOUT_ENV": "builtin/shop"}
    assert ServiceConfig.from_env(environ, adapter="areal").coalesce_seconds == 0.02
    zero = ServiceConfig.from_env({**environ, "ROLLOUT_COALESCE_SECONDS": "0"}, adapter="areal")
    assert zero.coalesce_seconds == 0
    for bad in ("soon", "-1", "nan", "inf"):
        with pytest.raises(ValueError, match="ROLLOUT_COALESCE_SECONDS must be seconds >= 0"):
            ServiceConfig.from_env({**environ, "ROLLOUT_COALESCE_SECONDS": bad}, adapter="areal")
    with pytest.raises(ValueError, match="seconds >= 0"):
        areal_adapter.ServiceWorkflow(
            coalesce_seconds=-0.1, service=ServiceConfig.from_env(environ, adapter="areal")
        )


async def test_a_refused_batch_fails_each_of_its_calls(service: tuple[str, SimWorker], db: Database) -> None:
    flow, engine = workflow(0.02), RemoteInfEngine()
    data = {"task_index": 10**6}  # past builtin/shop's test split
    calls = [flow.arun_episode(engine, data) for _ in range(3)]
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(r, RequestError) and r.status_code == 422 for r in results), results
    assert "task_indices" in str(results[0])
    assert await stored_batches(db) == {}


async def test_a_project_keys_steps_are_batches_in_its_scope(
    database_url: str, db: Database, monkeypatch: pytest.MonkeyPatch, tokenizer: Any
) -> None:
    """Under a project key (API_PROJECTS), the batches both adapters make of a step carry its prefix:
    any other id would be refused (422)."""
    projects = '{"team-a": {"keys": ["key-a"]}}'
    async with adapter_service(database_url, monkeypatch, api_keys="admin", api_projects=projects):
        monkeypatch.setenv("ROLLOUT_API_KEY", "key-a")
        flow, engine, actor = workflow(0.02), RemoteInfEngine(), RolloutRayActor(str(AGENT_FILE))
        params = SamplingParams(max_tokens=1024, logprobs=1)
        rows, responses = await asyncio.gather(
            asyncio.gather(*[flow.arun_episode(engine, {"task_index": 5}) for _ in range(2)]),
            actor.generate_responses("5", "5", params, 16384, tokenizer, num_samples=2),
        )
    batches = await stored_batches(db)
    assert len(batches) == 2 and all(batch.startswith("team-a:") for batch in batches), sorted(batches)
    assert len(rows) == 2 and len(responses) == 2
    assert all(len(episodes) == 2 for episodes in batches.values())
