"""tau2-bench through the service, on the REAL tau2: the oracle (tests/support/tau2_oracle.py)
replays tasks' ground truth as the policy, tau2's UserSimulator performs the user's share (telecom's
dual control) against a stub endpoint, and tau2's evaluator grades the simulation: reward 1.0, and
the stored tokens are exactly what the simulated SGLang worker saw and sampled.

tau2 is an optional install (not on PyPI, Python 3.12+): these tests skip without it. tau2 itself
(and litellm) is imported only by the service's env workers, never by this process.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from service.app import create_app
from service.envs import tau2_data
from service.envs.base import UserSimConfig
from service.serving import serve_app
from service.sim.policy import SimConfig
from service.sim.worker import SimWorker, create_sim_app, serve_in_thread
from tests.conftest import service_settings
from tests.support.contract import assert_trainer_contract, sim_calls
from tests.support.openai_stub import StubServer, openai_stub
from tests.support.tau2_oracle import Tau2Oracle

pytestmark = pytest.mark.skipif(
    not tau2_data.tau2_installed(),
    reason="tau2 (tau2-bench) not installed: an optional extra from its git repository, Python 3.12+",
)

# (env, split, task indexes): tasks of every domain, telecom's with user tool actions among them.
# Not mock's 7 and 8: the ground truth cannot pass them as tau2 ships them (7 lists no action for its
# env assertion; 8 asserts a notification read that no listed action reads).
ORACLE_TASKS = [
    ("tau2/mock", "base", [0, 3, 4, 5, 6, 9]),
    ("tau2/retail", "train", [0, 1, 2, 3, 16]),
    ("tau2/retail", "test", [5, 9, 36]),
    ("tau2/airline", "train", [0, 1, 3]),
    ("tau2/airline", "test", [2, 6, 8]),
    ("tau2/telecom", "small", list(range(20))),
    ("tau2/telecom", "train", [0, 1, 2]),
]


@pytest.fixture
def oracle() -> Tau2Oracle:
    return Tau2Oracle()


@pytest.fixture
def user_stub(oracle: Tau2Oracle) -> Iterator[StubServer]:
    with openai_stub(oracle.user) as stub:
        yield stub


@pytest.fixture
def sim(oracle: Tau2Oracle) -> Iterator[tuple[SimWorker, str]]:
    # No sampling mistakes: the oracle's plan as it is, in the sim's non-canonical tokens.
    config = SimConfig(
        latency_seconds=0.0,
        wrong_argument_rate=0.0,
        malformed_call_rate=0.0,
        ramble_rate=0.0,
        policy=oracle.policy,
    )
    worker = SimWorker(config)
    with serve_in_thread(create_sim_app(config, worker=worker)) as url:
        yield worker, url


@pytest.fixture
async def client(
    database_url: str, sim: tuple[SimWorker, str], user_stub: StubServer
) -> AsyncIterator[httpx.AsyncClient]:
    settings = service_settings(
        database_url,
        sim[1],
        env_executor="process",  # as deployed: tau2 in env worker processes
        user_sim=UserSimConfig(
            base_url=user_stub.base_url,
            model="user-model",
            seed=300,
            judge_base_url=user_stub.base_url,
            judge_model="judge-model",
        ),
    )
    async with serve_app(create_app(settings)) as url, httpx.AsyncClient(base_url=url, timeout=120) as http:
        yield http


async def test_envs_lists_the_domains_with_their_splits(client: httpx.AsyncClient) -> None:
    envs = {env["name"]: env for env in (await client.get("/envs")).json()}
    assert envs["tau2/retail"]["splits"] == {"train": 74, "test": 40, "base": 114}
    assert envs["tau2/telecom"]["splits"]["small"] == 20
    assert envs["tau2/telecom"]["splits"]["full"] == 2285
    assert envs["tau2/retail"]["judged_tasks"]["train"] > 0


@pytest.mark.slow
async def test_the_oracle_earns_reward_one_with_exact_tokens(
    client: httpx.AsyncClient, sim: tuple[SimWorker, str], oracle: Tau2Oracle
) -> None:
    root = tau2_data.data_dir()
    assert root is not None
    envs = {env["name"]: env for env in (await client.get("/envs")).json()}
    batches: list[tuple[str, str, str]] = []
    # Paused while the oracle learns which episode plays which task.
    async with httpx.AsyncClient(base_url=sim[1]) as engine:
        assert (await engine.post("/pause_generation", json={"mode": "in_place"})).status_code == 200
    for env, split, tasks in ORACLE_TASKS:
        body = {"batch_id": f"oracle-{env.replace('/', '-')}-{split}", "env": env, "task_split": split,
                "task_indices": tasks, "samples_per_task": 1, "max_turns": 40,
                "sampling_params": {"max_new_tokens": 1024}}  # fmt: skip
        response = await client.post("/episodes", json=body)
        if split in envs[env]["unavailable"]:  # the install lacks a data file: said, not run
            assert response.status_code == 422, response.text
            assert envs[env]["unavailable"][split].split(" is missing")[0] in response.json()["detail"]
            continue
        assert response.status_code == 202, response.text
        batches.append((body["batch_id"], env, split))
        split_tasks = tau2_data.read_tasks(root, env.removeprefix("tau2/"), split)
        for episode_id, index in zip(response.json()["episode_ids"], tasks, strict=True):
            oracle.episode_tasks[episode_id] = split_tasks[index]
    async with httpx.AsyncClient(base_url=sim[1]) as engine:
        assert (await engine.post("/continue_generation", json={})).status_code == 200
    assert batches
    for batch_id, env, split in batches:
        batch = (await client.get(f"/batches/{batch_id}", params={"wait": 600})).json()
        assert batch["complete"], batch["counts"]
        for summary in batch["episodes"]:
            episode = (await client.get(f"/episodes/{summary['id']}")).json()
            where = (env, split, summary["task_index"], episode["info"].get("task_id"), episode["error"])
            reward_info = episode["info"].get("reward_info")
            assert episode["status"] == "completed", where
            assert episode["reward"] == 1.0, (where, reward_info)
            assert reward_info["reward"] == 1.0
            calls = sim_calls(sim[0], episode["id"], episode["attempt"])
            assert len(calls) == episode["num_turns"]
            names = ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs")
            tokens = [episode[name] for name in names]
            assert_trainer_contract(*tokens, calls)
            if env == "tau2/telecom":
                users = [
                    a
                    for a in episode["info"]["task"]["evaluation_criteria"]["actions"]
                    if a["requestor"] == "user"
                ]
                shown = [m for m in episode["messages"] if m.get("env_only") and m["role"] == "user"]
                assert len(shown) == len(users)  # each user tool call in the transcript, none prompted
