"""verifiers environments as envs of the service (service/envs/verifiers_envs.py), with the real
verifiers package: two tasksets defined here (tests/verifiers_tasksets), a single-turn one played by
verifiers' null harness and a tool-using multi-turn one played by its bash harness, each run by
verifiers' own agent against the episode's OpenAI endpoint, on the simulated worker, on both
databases. verifiers 0.4 needs openai 2.x, which the dev extra's openai-agents does not take:
`make test-verifiers` runs this file in a virtualenv of its own (.venv-verifiers)."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("verifiers.v1", reason="verifiers is not installed here: `make test-verifiers` runs this")

from service.app import create_app
from service.serving import serve_app
from service.sim.worker import SimConfig, SimWorker, create_sim_app, serve_in_thread
from tests.conftest import service_settings
from tests.support.contract import assert_tokens_match_calls, generate_call

# verifiers imports a taskset by its id, a top-level module; the spawned env workers inherit sys.path.
TASKSETS = str(Path(__file__).parent / "verifiers_tasksets")
if TASKSETS not in sys.path:
    sys.path.insert(0, TASKSETS)

from vf_policy import policy  # noqa: E402  (the simulated worker's policy for both tasksets)

PLUGINS = "vf_plugins:env_specs"
ARITHMETIC = "verifiers/vf_arithmetic"
FILES = "verifiers/vf_files"


@asynccontextmanager
async def verifiers_service(database_url: str) -> AsyncIterator[tuple[httpx.AsyncClient, SimWorker]]:
    sim = SimWorker(SimConfig(latency_seconds=0.01, policy=policy))
    with serve_in_thread(create_sim_app(sim.config, worker=sim)) as sim_url:
        settings = service_settings(
            database_url, sim_url, env_plugins=PLUGINS, env_executor="process", env_workers=1
        )
        async with (
            serve_app(create_app(settings)) as url,
            httpx.AsyncClient(base_url=url, timeout=300) as http,
        ):
            settings.service_url = url  # where the env worker's drivers reach the episodes' endpoints
            yield http, sim


async def finished(http: httpx.AsyncClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    response = await http.post("/episodes", json=body)
    assert response.status_code == 202, response.text
    accepted = response.json()
    batch = (await http.get(f"/batches/{accepted['batch_id']}", params={"wait": 240})).json()
    errors = [e.get("error") for e in batch.get("episodes", [])]
    assert batch["complete"], (batch["counts"], errors)
    return [(await http.get(f"/episodes/{id_}")).json() for id_ in accepted["episode_ids"]]


def assert_calls_recorded_exactly(sim: SimWorker, episode: dict[str, Any], calls: int) -> None:
    """Every model call the harness made went through the episode's endpoint to the engine, and the
    stored tokens are exactly what the engine saw and sampled (one segment)."""
    requests = [r for r in sim.requests if r.rid.startswith(f"{episode['id']}:")]
    assert len(requests) == calls == episode["num_turns"]
    assert episode["segments"] == 1
    assert_tokens_match_calls(episode, [generate_call(r) for r in requests])


async def test_a_single_turn_verifiers_env_is_rewarded_by_its_rubric(database_url: str) -> None:
    async with verifiers_service(database_url) as (http, sim):
        listed = {env["name"]: env for env in (await http.get("/envs")).json()}
        assert listed[ARITHMETIC]["splits"] == {"train": 20, "test": 20}
        assert listed[ARITHMETIC]["train_split"] == "train"

        # No task_split: the env declares its training split. Task 0 (0 + 1) is answered right,
        # task 1 (1 + 2) off by one: the rubric's exact-match reward says so, per sample.
        body = {"env": ARITHMETIC, "task_indices": [0, 1], "samples_per_task": 2, "max_turns": 4}
        episodes = await finished(http, body)
        assert [e["status"] for e in episodes] == ["completed"] * 4, [e["error"] for e in episodes]
        assert [e["reward"] for e in episodes] == [1.0, 1.0, 0.0, 0.0]
        components = episodes[0]["info"]["verifiers"]
        assert components["rewards"] == {
            "exact": {"score": 1.0, "weight": 1.0},
            "short": {"score": 1.0, "weight": 0.0},  # in info, not in the reward
        }
        assert components["model_calls"] == 1
        assert episodes[2]["info"]["verifiers"]["rewards"]["exact"]["score"] == 0.0
        for episode in episodes:
            assert_calls_recorded_exactly(sim, episode, calls=1)
        # The prompt is the task's: the test split's config starts at another offset.
        test_split = await finished(
            http, body | {"task_split": "test", "task_indices": [0], "samples_per_task": 1}
        )
        assert test_split[0]["reward"] == 1.0
        assert "What is 100 + 101?" in str(test_split[0]["messages"])


async def test_a_tool_using_verifiers_env_plays_several_turns(database_url: str) -> None:
    async with verifiers_service(database_url) as (http, sim):
        body = {
            "env": FILES,
            "task_split": "train",
            "task_indices": [0, 1],
            "samples_per_task": 1,
            "max_turns": 6,
        }
        episodes = await finished(http, body)
        assert [e["status"] for e in episodes] == ["completed"] * 2, [e["error"] for e in episodes]
        # The file the bash tool wrote in the rollout's runtime (1) and the closing "Done." (0.5).
        assert [e["reward"] for e in episodes] == [1.5, 1.5]
        rewards = episodes[0]["info"]["verifiers"]["rewards"]
        assert rewards == {
            "wrote_file": {"score": 1.0, "weight": 1.0},
            "said_done": {"score": 1.0, "weight": 0.5},
        }
        for episode in episodes:
            assert_calls_recorded_exactly(sim, episode, calls=2)
            roles = [message["role"] for message in episode["messages"]]
            assert "tool" in roles  # the harness ran the call and sent its result back


async def test_a_rollout_past_its_turns_is_never_rewarded_0(database_url: str) -> None:
    """One turn allowed: the harness stops after its tool call; verifiers scores what it has, and
    the service finishes the episode as the trace ended, never a failure as reward 0."""
    async with verifiers_service(database_url) as (http, _):
        body = {
            "env": FILES,
            "task_split": "train",
            "task_indices": [2],
            "samples_per_task": 1,
            "max_turns": 1,
        }
        (episode,) = await finished(http, body)
        if episode["status"] == "completed":
            assert episode["reward"] is not None
            assert episode["info"]["verifiers"]["stop_condition"] is not None
        else:
            assert episode["status"] == "aborted" and episode["reward"] is None
            assert "verifiers rollout failed" in episode["error"]
