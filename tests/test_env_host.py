from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import pytest

from service.envs.base import Action, UserSimConfig
from service.envs.host import EnvError, EnvHost, EnvHostClosed, EnvHostError, EnvNotFound, EnvWorkerCrashed
from tests.envs_for_tests import TEST_ENVS

WHOAMI = Action("whoami", {})


@pytest.fixture(params=["process", "thread"])
async def host(request: pytest.FixtureRequest) -> AsyncIterator[EnvHost]:
    env_host = EnvHost(workers=2, executor=request.param, user_sim=UserSimConfig(model="m"), envs=TEST_ENVS)
    yield env_host
    await env_host.close()


@pytest.fixture
async def process_host() -> AsyncIterator[EnvHost]:
    env_host = EnvHost(workers=2, executor="process", envs=TEST_ENVS)
    yield env_host
    await env_host.close()


async def test_open_reset_step_close(host: EnvHost) -> None:
    session = await host.open("test/probe", "train", "ep-1")
    assert session.system_prompt == "probe env, split train"
    assert session.tools[0]["function"]["name"] == "whoami"
    reset = await session.reset(4)
    assert reset.observation == "task 4"
    step = await session.step(WHOAMI)
    assert step.observation.endswith("task 4")
    assert (step.reward, step.done) == (0.0, False)
    done = await session.step(Action("respond", {"content": "hi"}))
    assert (done.reward, done.done) == (1.0, True)
    await session.close()
    await session.close()  # idempotent
    with pytest.raises(EnvHostError, match="closed"):
        await session.step(WHOAMI)


async def test_env_work_runs_off_the_event_loop_process(process_host: EnvHost) -> None:
    session = await process_host.open("test/probe", "train", "ep")
    reset = await session.reset(0)
    assert reset.info["pid"] != os.getpid()
    assert session.pid == reset.info["pid"]
    await session.close()


async def test_episodes_are_pinned_and_spread(host: EnvHost) -> None:
    sessions = [await host.open("test/probe", "train", f"ep-{i}") for i in range(4)]
    for session in sessions:
        await session.reset(1)
    where: dict[int, set[tuple[int, int]]] = {}
    for _ in range(5):
        steps = await asyncio.gather(*(session.step(WHOAMI) for session in sessions))
        for i, step in enumerate(steps):
            where.setdefault(i, set()).add((step.info["pid"], step.info["thread"]))
    # Every episode always ran in the same process and thread: its env object lives there.
    assert all(len(places) == 1 for places in where.values())
    # Least-loaded placement: 4 episodes on 2 workers, 2 each.
    placements = [next(iter(where[i])) for i in range(4)]
    assert len(set(placements)) == 2
    assert all(placements.count(p) == 2 for p in set(placements))
    # State survives between calls, so each step saw its own env.
    last = await asyncio.gather(*(session.step(WHOAMI) for session in sessions))
    assert [step.info["steps"] for step in last] == [6, 6, 6, 6]
    for session in sessions:
        await session.close()


async def test_env_exception_is_env_error(host: EnvHost) -> None:
    session = await host.open("test/probe", "train", "ep")
    await session.reset(0)
    with pytest.raises(EnvError) as caught:
        await session.step(Action("boom", {}))
    assert caught.value.exc_type == "ValueError"
    assert caught.value.message == "boom at step 1"
    assert "Traceback" in caught.value.traceback and "envs_for_tests.py" in caught.value.traceback
    assert str(caught.value) == "ValueError: boom at step 1"
    # The env is still there and usable: the runner decides what an env error means.
    step = await session.step(WHOAMI)
    assert step.info["steps"] == 2
    await session.close()


async def test_factory_exception_is_env_error(host: EnvHost) -> None:
    with pytest.raises(EnvError, match="KeyError: 'cannot build split train'"):
        await host.open("test/failing", "train", "ep")
    session = await host.open("test/probe", "train", "ep")  # the worker is fine
    await session.close()


async def test_unpicklable_result_is_env_error(process_host: EnvHost) -> None:
    session = await process_host.open("test/probe", "train", "ep")
    with pytest.raises(EnvError, match="pickle"):
        await session.step(Action("unpicklable", {}))
    await session.close()


async def test_unknown_env_or_split(host: EnvHost) -> None:
    with pytest.raises(EnvNotFound, match="unknown environment 'nope'"):
        await host.open("nope", "train", "ep")
    with pytest.raises(EnvNotFound, match="no split 'dev'"):
        await host.open("test/probe", "dev", "ep")


async def test_worker_crash_fails_only_its_episodes(process_host: EnvHost) -> None:
    sessions = [await process_host.open("test/probe", "train", f"ep-{i}") for i in range(4)]
    pids = [(await session.reset(0)).info["pid"] for session in sessions]
    assert len(set(pids)) == 2
    doomed_pid = pids[0]
    with pytest.raises(
        EnvWorkerCrashed, match=rf"env worker 0\.\d+ died \(pid {doomed_pid} exited with code 7\)"
    ):
        await sessions[0].step(Action("crash", {"code": 7}))
    for session, pid in zip(sessions[1:], pids[1:], strict=True):
        if pid == doomed_pid:
            with pytest.raises(EnvWorkerCrashed, match="its episodes are lost"):
                await session.step(WHOAMI)
        else:
            step = await session.step(WHOAMI)
            assert step.info["pid"] == pid
    for session in sessions:
        await session.close()  # a no-op for the lost ones
    # The dead worker was replaced: new episodes run, on both workers again.
    fresh = [await process_host.open("test/probe", "train", f"new-{i}") for i in range(4)]
    fresh_pids = {(await session.step(WHOAMI)).info["pid"] for session in fresh}
    assert len(fresh_pids) == 2
    assert doomed_pid not in fresh_pids
    for session in fresh:
        await session.close()


async def test_crash_with_calls_in_flight(process_host: EnvHost) -> None:
    a = await process_host.open("test/probe", "train", "a")
    b = await process_host.open("test/probe", "train", "b")
    c = await process_host.open("test/probe", "train", "c")  # shares a's worker
    assert a.worker_name == c.worker_name != b.worker_name
    results = await asyncio.gather(
        a.step(Action("crash", {"code": 1})), c.step(WHOAMI), b.step(WHOAMI), return_exceptions=True
    )
    assert isinstance(results[0], EnvWorkerCrashed)
    assert isinstance(results[1], EnvWorkerCrashed)
    assert not isinstance(results[2], BaseException)
    for session in (a, b, c):
        await session.close()


async def test_idle_dead_worker_does_not_fail_a_new_episode(process_host: EnvHost) -> None:
    pids = await process_host.worker_pids()
    os.kill(pids[0], 9)
    sessions = [await process_host.open("test/probe", "train", f"ep-{i}") for i in range(2)]
    new_pids = {(await session.reset(0)).info["pid"] for session in sessions}
    assert pids[0] not in new_pids
    for session in sessions:
        await session.close()


async def test_closed_host_refuses_work() -> None:
    env_host = EnvHost(workers=1, executor="thread", envs=TEST_ENVS)
    session = await env_host.open("test/probe", "train", "ep")
    await env_host.close()
    await env_host.close()
    with pytest.raises(EnvHostClosed):
        await session.step(WHOAMI)
    await session.close()
    with pytest.raises(EnvHostClosed):
        await env_host.open("test/probe", "train", "ep2")


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="executor"):
        EnvHost(workers=1, executor="fiber", envs=TEST_ENVS)
    with pytest.raises(ValueError, match="workers"):
        EnvHost(workers=0, envs=TEST_ENVS)
