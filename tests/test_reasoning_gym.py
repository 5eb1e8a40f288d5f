"""reasoning-gym's datasets as `reasoning-gym/<dataset>` envs, for real (the extra `make install`
installs): listed without importing it, splits disjoint by seed, score_answer as the reward, the
entry in info; end to end through the service with the simulated worker."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from service.app import create_app
from service.envs import reasoning_gym_envs as rg
from service.envs.api import RESPOND_ACTION_NAME, Action, UserSimConfig, check_reset, check_step
from service.envs.registry import available_envs
from service.serving import serve_app
from service.sim.policy import parse_chatml
from service.sim.worker import SimConfig, SimWorker, create_sim_app, serve_in_thread
from tests.conftest import service_settings

# Looked up, not imported: importing reasoning-gym (about 2 s of CPU) here made every pytest-xdist
# worker pay for it while collecting; the tests that run its datasets import it.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("reasoning_gym") is None, reason="reasoning-gym is not installed"
)

DATASETS = ["chain_sum", "letter_counting", "word_sorting", "spell_backward", "gcd", "basic_arithmetic"]


def test_the_listed_datasets_are_the_installed_ones() -> None:
    from reasoning_gym.factory import DATASETS as INSTALLED

    assert set(rg.DATASETS) == set(INSTALLED)
    envs = available_envs()
    listed = {name.removeprefix(rg.PREFIX) for name in envs if name.startswith(rg.PREFIX)}
    assert listed == set(INSTALLED) - rg.UNLISTED
    spec = envs["reasoning-gym/chain_sum"]
    assert spec.splits == {"train": rg.TRAIN_SIZE, "test": rg.TEST_SIZE} and spec.train_split == "train"
    assert spec.source.startswith("entry point reasoning-gym (rollout-service ")


def test_listing_does_not_import_reasoning_gym() -> None:
    code = (
        "import sys, time; from service.envs.registry import available_envs; started = time.perf_counter(); "
        "envs = available_envs(); assert 'reasoning-gym/gcd' in envs; "
        "assert 'reasoning_gym' not in sys.modules; print(time.perf_counter() - started)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout.strip().splitlines()[-1]) < 1.0


def test_train_and_test_seeds_never_overlap() -> None:
    (train_first, train_size), (test_first, _) = rg.SPLITS["train"], rg.SPLITS["test"]
    assert train_first + train_size <= test_first
    env = rg.make_env("chain_sum", "test", UserSimConfig())
    assert env.reset(0).info["seed"] == train_first + train_size


@pytest.mark.parametrize("name", DATASETS)
def test_the_datasets_answer_scores_one_and_a_wrong_one_less(name: str) -> None:
    for split in ("train", "test"):
        for index in (0, 7):
            env = rg.make_env(name, split, UserSimConfig())
            reset = check_reset(env.reset(index))
            entry = reset.info["entry"]
            assert reset.observation == entry["question"] and reset.info["dataset"] == name
            assert env.tools == [] and "<answer>" in env.system_prompt
            no_tools = check_step(env.step(Action("calculator", {})))
            assert not no_tools.done
            right = check_step(
                env.step(Action(RESPOND_ACTION_NAME, {"content": f"<answer>{entry['answer']}</answer>"}))
            )
            assert (right.reward, right.done) == (1.0, True)
            assert right.info["reward_info"]["extracted_answer"] == str(entry["answer"]).strip()
            wrong = rg.make_env(name, split, UserSimConfig())
            wrong.reset(index)
            assert (
                wrong.step(Action(RESPOND_ACTION_NAME, {"content": "<answer>no idea</answer>"})).reward < 1.0
            )
    first_train = rg.make_env(name, "train", UserSimConfig()).reset(0).info["entry"]
    first_test = rg.make_env(name, "test", UserSimConfig()).reset(0).info["entry"]
    assert first_train != first_test


def oracle(prompt: str, key: str) -> str:
    """Answers each question right: the dataset rebuilt here, by the same seeds, finds it."""
    question = next(content for role, content, _ in parse_chatml(prompt) if role == "user")
    for name in DATASETS[:2]:
        for split in rg.SPLITS:
            data = rg.dataset(name, split)
            for index in range(4):
                if data[index]["question"] == question:
                    return f"Thinking... <answer>{data[index]['answer']}</answer>"
    return "<answer>?</answer>"


@pytest.fixture(params=["oracle", "generic"])
async def service(
    database_url: str, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[str, httpx.AsyncClient]]:
    worker = SimWorker(SimConfig(latency_seconds=0.01, policy=oracle if request.param == "oracle" else None))
    with serve_in_thread(create_sim_app(worker.config, worker=worker)) as sim_url:
        settings = service_settings(database_url, sim_url, env_executor="process", env_workers=1)
        async with (
            serve_app(create_app(settings)) as url,
            httpx.AsyncClient(base_url=url, timeout=60) as http,
        ):
            yield request.param, http


async def test_reasoning_gym_runs_end_to_end(service: tuple[str, httpx.AsyncClient]) -> None:
    policy, client = service
    for name in DATASETS[:2]:
        body: dict[str, Any] = {"env": f"reasoning-gym/{name}", "task_indices": [0, 3], "samples_per_task": 2}
        response = await client.post("/episodes", json=body)  # no task_split: the env declares train
        assert response.status_code == 202, response.text
        accepted = response.json()
        batch = (await client.get(f"/batches/{accepted['batch_id']}", params={"wait": 60})).json()
        assert batch["complete"] and batch["task_split"] == "train"
        for episode_id in accepted["episode_ids"]:
            episode = (await client.get(f"/episodes/{episode_id}")).json()
            assert episode["status"] == "completed", episode["error"]
            assert episode["reward"] == (1.0 if policy == "oracle" else 0.0)
            assert episode["info"]["entry"]["answer"] and episode["info"]["dataset"] == name
            assert episode["messages"][1]["content"] == episode["info"]["entry"]["question"]
