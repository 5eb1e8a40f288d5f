from __future__ import annotations

import asyncio
import itertools
import os
import pickle
import time
from collections.abc import AsyncIterator

import pytest

from service.envs.base import Action, UserSimConfig
from service.envs.errors import (
    EnvCallTimeout,
    EnvError,
    EnvHostClosed,
    EnvHostError,
    EnvNotFound,
    EnvWorkerCrashed,
)
from service.envs.host import EnvHost
from tests.support.envs import TEST_ENVS
from tests.support.polling import until

WHOAMI = Action("whoami", {})


@pytest.fixture(params=["process", "thread"])
async def host(request: pytest.FixtureRequest) -> AsyncIterator[EnvHost]:
    env_host = EnvHost(workers=2, executor=request.param, user_sim=UserSimConfig(model="m"), envs=TEST_ENVS)
    yield env_host
    await env_host.close()


@pytest.fixture(params=["process", "thread"])
def executor(request: pytest.FixtureRequest) -> str:
    return str(request.param)


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
    pids: dict[int, set[int]] = {}
    for _ in range(5):
        steps = await asyncio.gather(*(session.step(WHOAMI) for session in sessions))
        for i, step in enumerate(steps):
            pids.setdefault(i, set()).add(step.info["pid"])
    # Every episode always ran in the same process: its env object lives there.
    assert all(len(places) == 1 for places in pids.values())
    # Least-loaded placement: 4 episodes on 2 workers, 2 each (and 2 processes in process mode).
    workers = [session.worker_name for session in sessions]
    assert sorted(workers.count(name) for name in set(workers)) == [2, 2]
    if host.executor_kind == "process":
        assert len({session.pid for session in sessions}) == 2
    # State survives between calls, so each step saw its own env.
    last = await asyncio.gather(*(session.step(WHOAMI) for session in sessions))
    assert [step.info["steps"] for step in last] == [6, 6, 6, 6]
    for session in sessions:
        await session.close()


async def test_calls_of_many_episodes_overlap_in_one_worker(executor: str) -> None:
    # User-simulator turns block on HTTP inside env.step: one worker must not serialize them.
    env_host = EnvHost(workers=1, executor=executor, envs=TEST_ENVS)
    try:
        sessions = [await env_host.open("test/probe", "train", f"ep-{i}") for i in range(8)]
        started = time.monotonic()
        steps = await asyncio.gather(*(s.step(Action("sleep", {"seconds": 0.3})) for s in sessions))
        elapsed = time.monotonic() - started
        assert elapsed < 1.0, f"8 calls of 0.3 s took {elapsed:.2f} s"
        assert len({step.info["pid"] for step in steps}) == 1
        assert len({step.info["thread"] for step in steps}) == 8
    finally:
        await env_host.close()


async def test_calls_of_one_env_run_one_at_a_time_in_order(host: EnvHost) -> None:
    session = await host.open("test/probe", "train", "ep")
    naps = [0.2, 0.0, 0.1, 0.0]
    steps = await asyncio.gather(
        *(session.step(Action("sleep", {"seconds": nap, "tag": i})) for i, nap in enumerate(naps))
    )
    assert [step.info["steps"] for step in steps] == [1, 2, 3, 4]
    assert steps[-1].info["tags"] == [0, 1, 2, 3]
    for before, after in itertools.pairwise(steps):
        assert before.info["ended"] <= after.info["started"]
    await session.close()


async def orphans_dropped(host: EnvHost) -> None:
    """Until an open its caller gave up on has been built and dropped. The build finishes in the
    worker anyway, whenever the worker gets to it (not within a fixed time: a worker process started
    for the test, on a loaded machine, had not built it 0.8 s later), then the host drops what it
    built, submitting the drop as the build's answer arrives, a step of the event loop after it:
    so, no call in flight twice in a row."""
    for _ in range(2):
        await until(lambda: host.calls_in_flight() == 0, timeout_seconds=60)
        await asyncio.sleep(0.01)


async def test_cancel_during_open_leaves_no_env_behind(host: EnvHost) -> None:
    opening = asyncio.create_task(host.open("test/slow", "train", "ep"))
    await asyncio.sleep(0.1)
    opening.cancel()
    with pytest.raises(asyncio.CancelledError):
        await opening
    await orphans_dropped(host)
    assert await host.open_envs() == 0
    session = await host.open("test/probe", "train", "ep2")
    assert await host.open_envs() == 1
    await session.close()
    assert await host.open_envs() == 0


async def test_timed_out_open_leaves_no_env_behind(executor: str) -> None:
    env_host = EnvHost(workers=1, executor=executor, envs=TEST_ENVS, call_timeout_seconds=0.1)
    try:
        with pytest.raises(
            EnvError, match=r"open of 'test/slow' for episode 'ep' did not return within 0.1 s"
        ):
            await env_host.open("test/slow", "train", "ep")
        env_host.call_timeout_seconds = 60  # the count, under no short timeout
        await orphans_dropped(env_host)
        assert await env_host.open_envs() == 0
    finally:
        await env_host.close()


async def test_hung_call_times_out_and_close_is_bounded(executor: str) -> None:
    grace, timeout = 0.5, 1.0
    env_host = EnvHost(
        workers=1, executor=executor, envs=TEST_ENVS, call_timeout_seconds=60, shutdown_grace_seconds=grace
    )
    # The worker starts first, under no short timeout: a process's start-up (its imports, on a loaded
    # machine) is not the env call this test times, and took longer than a short one in CI-like runs.
    await env_host.worker_pids()
    env_host.call_timeout_seconds = timeout
    session = await env_host.open("test/probe", "train", "ep")
    other = await env_host.open("test/probe", "train", "other")
    hang = 4.0 if executor == "thread" else 60.0  # a thread cannot be killed: keep the test's exit short
    with pytest.raises(EnvError) as caught:
        await session.step(Action("sleep", {"seconds": hang}))
    assert caught.value.exc_type == "TimeoutError"
    assert str(caught.value) == "TimeoutError: step 'sleep' of episode 'ep' did not return within 1 s"
    # The session is abandoned (its env may be mid-call); other episodes carry on.
    with pytest.raises(EnvError, match="abandoned"):
        await session.step(WHOAMI)
    assert (await other.step(WHOAMI)).info["steps"] == 1
    await session.close()
    await other.close()
    started = time.monotonic()
    await env_host.close()
    # Bounded by the grace and a kill, not by the hung call (60 s): 3 s sufficed on an idle
    # machine, a loaded one took 5.4 s.
    assert time.monotonic() - started < grace + 15.0


async def test_env_exception_is_env_error(host: EnvHost) -> None:
    session = await host.open("test/probe", "train", "ep")
    await session.reset(0)
    with pytest.raises(EnvError) as caught:
        await session.step(Action("boom", {}))
    assert caught.value.exc_type == "ValueError"
    assert caught.value.message == "boom at step 1"
    assert "Traceback" in caught.value.traceback and "support/envs.py" in caught.value.traceback
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


async def test_crash_fails_only_that_workers_calls_in_flight(process_host: EnvHost) -> None:
    a = await process_host.open("test/probe", "train", "a")
    b = await process_host.open("test/probe", "train", "b")
    c = await process_host.open("test/probe", "train", "c")  # shares a's worker
    d = await process_host.open("test/probe", "train", "d")  # shares b's worker
    assert a.worker_name == c.worker_name != b.worker_name == d.worker_name
    nap = Action("sleep", {"seconds": 0.5})
    results = await asyncio.gather(
        c.step(nap), b.step(nap), d.step(nap), a.step(Action("crash", {"code": 1})), return_exceptions=True
    )
    assert isinstance(results[0], EnvWorkerCrashed) and f"pid {a.pid} exited with code 1" in str(results[0])
    assert isinstance(results[3], EnvWorkerCrashed)
    assert [step.info["steps"] for step in results[1:3] if not isinstance(step, BaseException)] == [1, 1]
    with pytest.raises(EnvWorkerCrashed, match="its episodes are lost"):
        await c.step(WHOAMI)
    for session in (a, b, c, d):
        await session.close()
    # Later episodes run, on a replacement for the dead worker.
    fresh = [await process_host.open("test/probe", "train", f"new-{i}") for i in range(2)]
    pids = await process_host.worker_pids()
    assert a.pid not in pids and b.pid in pids
    assert {(await session.step(WHOAMI)).info["pid"] for session in fresh} == set(pids)
    for session in fresh:
        await session.close()
    assert await process_host.open_envs() == 0


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


def test_env_error_says_if_it_is_infrastructure_across_pickling() -> None:
    errors = [
        EnvError.from_exception(TimeoutError("slow")),
        EnvError.from_exception(ValueError("bad")),
        EnvCallTimeout("step 'x' of episode 'ep' did not return within 1 s"),
    ]
    assert [error.infrastructure for error in errors] == [True, False, True]
    for error in errors:
        copy = pickle.loads(pickle.dumps(error))
        assert (type(copy), str(copy), copy.infrastructure) == (type(error), str(error), error.infrastructure)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="executor"):
        EnvHost(workers=1, executor="fiber", envs=TEST_ENVS)
    with pytest.raises(ValueError, match="workers"):
        EnvHost(workers=0, envs=TEST_ENVS)
