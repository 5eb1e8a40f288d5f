"""The example environment package (examples/helpdesk_env, installed by `make install`): tested
alone as an env author would, then listed and run through the service by its entry point, with the
simulated worker's generic policy and with the package's own `--policy`."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from typing import Any

import httpx
import jsonschema
import pytest
from helpdesk_env import env_specs
from helpdesk_env.desk import TOOLS, make_env, tasks
from helpdesk_env.oracle import reply as oracle_reply

from service.app import create_app
from service.envs.api import RESPOND_ACTION_NAME, Action, UserSimConfig, check_reset, check_step
from service.envs.builtin.shop import TOOLS as SHOP_TOOLS
from service.serving import serve_app
from service.sim.arguments import arguments_for
from service.sim.policy import GENERIC_ANSWER, SimConfig
from service.sim.worker import SimWorker, create_sim_app, serve_in_thread
from tests.conftest import service_settings

ENV = "helpdesk/it-support"


def test_the_env_alone_rewards_the_ground_truth_and_nothing_else() -> None:
    for index, task in enumerate(tasks("test")):
        env = make_env("test", UserSimConfig())
        reset = check_reset(env.reset(index))
        assert reset.observation == task.request and reset.info["ground_truth"]
        for action in task.actions:
            assert not check_step(env.step(action)).done
        end = check_step(env.step(Action(RESPOND_ACTION_NAME, {"content": "Done."})))
        assert (end.reward, end.done) == (1.0, True)

        idle = make_env("test", UserSimConfig())
        idle.reset(index)
        assert (
            idle.step(Action(RESPOND_ACTION_NAME, {"content": "Anything else?"})).observation
            == "Yes, please do."
        )
        assert idle.step(Action(RESPOND_ACTION_NAME, {"content": "Bye."})).reward == 0.0


COMPLEX_SCHEMA = {
    "type": "object",
    "properties": {
        "count": {"type": "integer", "minimum": 3, "exclusiveMaximum": 9},
        "ratio": {"type": "number", "maximum": -2},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 3},
            "minItems": 2,
            "uniqueItems": True,
        },
        "mode": {"enum": ["a", "b"]},
        "nested": {"type": "object", "properties": {"flag": {"type": "boolean"}}, "required": ["flag"]},
        "maybe": {"type": ["null", "string"], "minLength": 20},
        "either": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        "fixed": {"const": 7},
    },
    "required": ["count", "ratio", "tags", "mode", "nested", "maybe", "either", "fixed"],
}


@pytest.mark.parametrize("seed", range(50))
def test_generic_arguments_are_valid_for_their_schemas(seed: int) -> None:
    rng = random.Random(seed)
    for tool in [*TOOLS, *SHOP_TOOLS]:
        parameters = tool["function"]["parameters"]
        jsonschema.validate(arguments_for(parameters, rng), parameters)
    jsonschema.validate(arguments_for(COMPLEX_SCHEMA, rng), COMPLEX_SCHEMA)


def test_the_entry_point_lists_the_package() -> None:
    (spec,) = env_specs()
    assert spec.name == ENV and spec.train_split == "train"


@pytest.fixture(params=["generic", "oracle"])
async def service(
    database_url: str, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[str, httpx.AsyncClient]]:
    policy = oracle_reply if request.param == "oracle" else None
    worker = SimWorker(SimConfig(latency_seconds=0.01, policy=policy))
    with serve_in_thread(create_sim_app(worker.config, worker=worker)) as sim_url:
        settings = service_settings(database_url, sim_url, env_executor="process", env_workers=1)
        async with (
            serve_app(create_app(settings)) as url,
            # Longer than the batch's long poll below: at a load average of 15-20 the episodes'
            # env worker process took more than 30 s to start, and the poll's read timed out first.
            httpx.AsyncClient(base_url=url, timeout=90) as http,
        ):
            yield request.param, http


async def test_the_example_runs_end_to_end_through_the_service(
    service: tuple[str, httpx.AsyncClient],
) -> None:
    policy, client = service
    listed = {env["name"]: env for env in (await client.get("/envs")).json()}
    assert listed[ENV]["source"] == "entry point helpdesk (rollout-helpdesk-env 0.1.0)"
    assert listed[ENV]["splits"] == {"train": 120, "test": 30}

    body: dict[str, Any] = {
        "env": ENV,
        "task_split": "test",
        "task_indices": [0, 1, 2],
        "samples_per_task": 2,
    }
    accepted = (await client.post("/episodes", json=body | {"max_turns": 6})).json()
    batch = (await client.get(f"/batches/{accepted['batch_id']}", params={"wait": 60})).json()
    episodes = [(await client.get(f"/episodes/{id_}")).json() for id_ in accepted["episode_ids"]]
    assert batch["complete"] and batch["counts"]["completed"] == 6, episodes[0]["error"]
    for episode in episodes:
        assert episode["info"]["ground_truth"], episode["info"]  # info reaches the trainer's records
        tool_answers = [m for m in episode["messages"] if m["role"] == "tool"]
        if policy == "oracle":
            assert episode["reward"] == 1.0
            assert len(tool_answers) == 1
        else:
            # The generic policy: each tool once with schema-valid arguments (the desk answers
            # `Error: no employee ...` to made-up ids, never a bad-arguments error), then an answer.
            assert episode["reward"] == 0.0
            assert [m["name"] for m in tool_answers] == [
                "lookup_employee",
                "unlock_account",
                "reset_password",
            ]
            assert not any("bad arguments" in m["content"] for m in tool_answers)
            answer = {"role": "assistant", "content": GENERIC_ANSWER, "sampled": GENERIC_ANSWER}
            assert episode["messages"][-2] == answer
