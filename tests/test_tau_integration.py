"""The adapter on the REAL tau-bench: replaying a task's ground-truth actions earns reward 1.0.

tau_bench is an optional extra (not on PyPI); these tests skip without it.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.envs.base import RESPOND_ACTION_NAME, Action, Step, UserSimConfig
from service.envs.host import EnvHost
from service.envs.registry import TAU_BENCH_ENVS
from service.envs.tau import TauBenchEnvironment
from tests.support.openai_stub import StubServer, openai_stub

STANDIN_DIR = Path(__file__).parent / "tau_standin"


def real_tau_bench_installed() -> bool:
    spec = importlib.util.find_spec("tau_bench")
    return spec is not None and not str(spec.origin).startswith(str(STANDIN_DIR))


pytestmark = pytest.mark.skipif(
    not real_tau_bench_installed(),
    reason="tau_bench not installed (optional extra; install from its git repository)",
)


def agreeable_user(messages: list[dict[str, Any]]) -> str:
    if len(messages) == 2:
        return "Hi, I need help with my request."
    return "###STOP###"


@pytest.fixture
def user_server() -> Iterator[StubServer]:
    with openai_stub(agreeable_user) as server:
        yield server


def sim_config(server: StubServer) -> UserSimConfig:
    return UserSimConfig(base_url=server.base_url, model="user-model", temperature=0.0, seed=1)


def replay_ground_truth(info: dict[str, Any]) -> list[Action]:
    task = info["task"]
    actions = [Action(a["name"], a["kwargs"]) for a in task["actions"]]
    # The outputs must appear in something the agent said to the user.
    return [*actions, Action(RESPOND_ACTION_NAME, {"content": "Done. " + " ".join(task["outputs"])})]


def play(env: TauBenchEnvironment, task_index: int) -> Step:
    reset = env.reset(task_index)
    for action in replay_ground_truth(reset.info):
        step = env.step(action)
        if step.done:
            return step
    raise AssertionError("the episode did not end")


def tasks_to_replay(domain: str, split: str, user_sim: UserSimConfig) -> list[int]:
    """The first task, and the first whose reward also checks outputs (train has none)."""
    tasks = TauBenchEnvironment(domain, split, user_sim)._env.tasks
    with_outputs = [i for i, task in enumerate(tasks) if task.outputs][:1]
    return [0, *with_outputs]


def test_registry_counts_match_the_package() -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    from tau_bench.envs import get_env

    for spec in TAU_BENCH_ENVS:
        for split, count in spec.splits.items():
            env = get_env(spec.name.split("/")[1], "human", "m", split, task_index=0)
            assert len(env.tasks) == count, (spec.name, split)


@pytest.mark.parametrize(("domain", "split"), [("retail", "test"), ("retail", "train"), ("airline", "test")])
def test_ground_truth_earns_reward_one(user_server: StubServer, domain: str, split: str) -> None:
    user_sim = sim_config(user_server)
    for task_index in tasks_to_replay(domain, split, user_sim):
        env = TauBenchEnvironment(domain, split, user_sim)
        assert "#" in env.system_prompt and env.tools
        final = play(env, task_index)
        assert final.reward == 1.0, (task_index, final.info["reward_info"])
        assert final.info["reward_info"]["reward"] == 1.0
        assert final.info["task"]["actions"]  # ground truth, for the trainer
        if final.info["task"]["outputs"]:
            assert all(final.info["reward_info"]["info"]["outputs"].values())
    for body in user_server.requests:
        assert (body["temperature"], body["seed"]) == (0.0, 1)


def test_doing_nothing_earns_zero(user_server: StubServer) -> None:
    env = TauBenchEnvironment("retail", "test", sim_config(user_server))
    env.reset(0)
    final = env.step(Action(RESPOND_ACTION_NAME, {"content": "Sorry, I cannot help."}))
    assert (final.reward, final.done) == (0.0, True)


async def test_ground_truth_in_env_workers(user_server: StubServer) -> None:
    host = EnvHost(workers=1, user_sim=sim_config(user_server), envs={s.name: s for s in TAU_BENCH_ENVS})
    try:
        session = await host.open("tau-bench/retail", "test", "ep")
        assert session.pid != os.getpid()
        reset = await session.reset(3)
        final = None
        for action in replay_ground_truth(reset.info):
            final = await session.step(action)
            if final.done:
                break
        assert final is not None and final.reward == 1.0
        await session.close()
    finally:
        await host.close()
