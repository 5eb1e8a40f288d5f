"""Environment plugins: entry points and ENV_PLUGINS loaders, listed and run through the service;
bad plugins listed unavailable with their error; misbehaving envs' failures classified."""

from __future__ import annotations

import asyncio
import re
import textwrap
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.app import create_app
from service.envs.api import Action
from service.envs.host import EnvHost
from service.envs.registry import available_envs
from service.serving import serve_app
from service.sim.policy import parse_chatml
from service.sim.worker import SimConfig, SimWorker, create_sim_app, serve_in_thread
from service.storage.db import Database
from tests.conftest import service_settings
from tests.support.plugin_envs import HANG_SECONDS
from tests.support.service_process import service_process, simulated_sglang, wait_batch_finished

GOOD = "tests.support.plugin_envs:env_specs"
BAD_LOADERS = [
    "no_such_module_xyz:specs",
    "tests.support.plugin_envs:raising",
    "tests.support.plugin_envs:NOT_A_FUNCTION",
    "tests.support.plugin_envs:invalid_specs",
    "missing-colon",
]


def test_a_loader_setting_adds_its_envs() -> None:
    envs = available_envs([GOOD])
    assert envs["plugin/counter"].splits == {"train": 20, "test": 5}
    assert envs["plugin/counter"].source == f"ENV_PLUGINS {GOOD}"
    assert envs["builtin/shop"].source == "builtin"


def test_bad_plugins_are_listed_unavailable_with_their_error() -> None:
    envs = available_envs([GOOD, *BAD_LOADERS])
    assert "*" not in envs["plugin/counter"].unavailable
    assert "*" not in envs["builtin/shop"].unavailable  # a plugin never shadows a working env
    errors = {name: spec.unavailable["*"] for name, spec in envs.items() if "*" in spec.unavailable}
    assert "No module named 'no_such_module_xyz'" in errors["no_such_module_xyz:specs"]
    assert "RuntimeError: the plugin's loader failed" in errors["tests.support.plugin_envs:raising"]
    assert "not callable" in errors["tests.support.plugin_envs:NOT_A_FUNCTION"]
    assert "is not module:function" in errors["missing-colon"]
    assert "factory must pickle" in errors["plugin/lambda"]
    assert "train_split 'train' is not one of its splits" in errors["plugin/wrong-train"]
    assert "env protocol 2" in errors["plugin/future"]
    invalid = errors["tests.support.plugin_envs:invalid_specs"]
    assert "'builtin/shop' is already defined (builtin)" in invalid
    assert "not an EnvSpec: builtins.str" in invalid


def test_an_installed_entry_point_is_listed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A package installed as pip installs one: its dist-info on sys.path, with entry_points.txt.
    (tmp_path / "ep_envs.py").write_text("from tests.support.plugin_envs import env_specs\n")
    info = tmp_path / "ep_envs-1.2.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-envs\nVersion: 1.2\n")
    (info / "entry_points.txt").write_text(
        textwrap.dedent(
            """\
            [rollout_service.envs]
            ep-envs = ep_envs:env_specs
            broken = ep_envs_missing:env_specs
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    envs = available_envs()
    assert envs["plugin/counter"].source == "entry point ep-envs (ep-envs 1.2)"
    assert "No module named 'ep_envs_missing'" in envs["broken"].unavailable["*"]


@pytest.mark.parametrize("executor", ["process", "thread"])
async def test_plugin_envs_run_in_spawned_env_workers(executor: Any) -> None:
    host = EnvHost(1, executor, envs=available_envs([GOOD]))
    try:
        session = await host.open("plugin/counter", "train", "ep")
        reset = await session.reset(2)
        assert reset.info == {"target": 3}
        await session.step(Action("add", {"amount": 3}))
        step = await session.step(Action("respond", {"content": "done"}))
        assert (step.reward, step.done, step.info) == (1.0, True, {"final_counter": 3})
        await session.close()
    finally:
        await host.close()


def counter_policy(prompt: str, key: str) -> str:
    """Plays plugin/counter: adds the target at once, then answers (a `--policy` for the sim)."""
    messages = parse_chatml(prompt)
    first_user = next(content for role, content, _ in messages if role == "user")
    if not any(role == "assistant" for role, _, closed in messages if closed):
        target = int(re.findall(r"\d+", first_user)[0])
        return f'<tool_call>\n{{"name": "add", "arguments": {{"amount": {target}}}}}\n</tool_call>'
    return "Done."


@asynccontextmanager
async def plugin_service(database_url: str, **overrides: Any) -> AsyncIterator[httpx.AsyncClient]:
    """The service with the test plugins (good and bad) in a spawned env worker, against a simulated
    worker playing plugin/counter."""
    worker = SimWorker(SimConfig(latency_seconds=0.01, policy=counter_policy))
    plugins = ",".join([GOOD, *BAD_LOADERS])
    with serve_in_thread(create_sim_app(worker.config, worker=worker)) as sim_url:
        settings = service_settings(
            database_url, sim_url, env_plugins=plugins, env_executor="process", env_workers=1, **overrides
        )
        async with (
            serve_app(create_app(settings)) as url,
            # Longer than finished_episodes' long poll (60 s): at 30 s a loaded machine, whose spawned
            # env worker took that long to start, saw a ReadTimeout instead of the batch.
            httpx.AsyncClient(base_url=url, timeout=90) as http,
        ):
            yield http


@pytest.fixture
async def plugin_client(database_url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with plugin_service(database_url) as http:
        yield http


def submission(env: str, split: str, tasks: list[int], **overrides: Any) -> dict[str, Any]:
    body = {"env": env, "task_split": split, "task_indices": tasks, "samples_per_task": 2, "max_turns": 4}
    return body | overrides


async def finished_episodes(client: httpx.AsyncClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    response = await client.post("/episodes", json=body)
    assert response.status_code == 202, response.text
    accepted = response.json()
    batch = (await client.get(f"/batches/{accepted['batch_id']}", params={"wait": 60})).json()
    assert batch["complete"], batch["counts"]
    return [(await client.get(f"/episodes/{id_}")).json() for id_ in accepted["episode_ids"]]


async def test_a_plugin_env_runs_end_to_end_and_bad_ones_are_422(plugin_client: httpx.AsyncClient) -> None:
    listed = {env["name"]: env for env in (await plugin_client.get("/envs")).json()}
    assert listed["plugin/counter"]["splits"] == {"train": 20, "test": 5}
    assert listed["plugin/counter"]["source"] == f"ENV_PLUGINS {GOOD}"
    assert "No module named" in listed["no_such_module_xyz:specs"]["unavailable"]["*"]

    episodes = await finished_episodes(plugin_client, submission("plugin/counter", "train", [0, 4]))
    assert [e["status"] for e in episodes] == ["completed"] * 4
    assert [e["reward"] for e in episodes] == [1.0] * 4
    assert episodes[2]["info"] == {"target": 5, "final_counter": 5}

    for env, needle in [
        ("plugin/lambda", "factory must pickle"),
        ("no_such_module_xyz:specs", "No module named 'no_such_module_xyz'"),
    ]:
        response = await plugin_client.post("/episodes", json=submission(env, "train", [0]))
        assert response.status_code == 422, response.text
        assert needle in response.text


async def test_a_failed_entry_points_envs_are_422_naming_its_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, database_url: str
) -> None:
    info = tmp_path / "gone-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: gone\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[rollout_service.envs]\ngone = gone_envs:env_specs\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    app = create_app(service_settings(database_url, "http://127.0.0.1:9", run_worker=False))
    async with serve_app(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
        response = await http.post("/episodes", json=submission("gone/desk", "train", [0]))
    assert response.status_code == 422
    assert "No module named 'gone_envs'" in response.text


MISBEHAVING = {  # the plugin/misbehaving split: what its episodes' error says
    "reset": "env reset failed: ValueError: reset exploded",
    "step": "env step failed: ValueError: step exploded",
    "late": "env step failed: ValueError: step exploded after a reward",
    "nan": "unstorable info: step().info['score'] is nan",
    "surrogate": "unstorable transcript: step().transcript[0]['content'] holds a lone surrogate",
    "object": "unstorable info: step().info['when'] is a builtins.object, not JSON",
}


async def test_misbehaving_envs_abort_with_their_error(plugin_client: httpx.AsyncClient) -> None:
    # One service for every case (its spawned env worker is most of a case's time), side by side.
    bodies = [submission("plugin/misbehaving", split, [0]) for split in MISBEHAVING]
    finished = await asyncio.gather(*(finished_episodes(plugin_client, body) for body in bodies))
    for (split, needle), episodes in zip(MISBEHAVING.items(), finished, strict=True):
        for episode in episodes:
            assert episode["status"] == "aborted", (split, episode)
            assert needle in episode["error"], (split, episode["error"])
            # The env's own last reward if it gave one before failing (docs/trainers/statuses.md, aborted).
            assert episode["reward"] == (0.0 if split == "late" else None), (split, episode)


async def test_plugins_load_in_every_process_of_serve_workers_and_api_processes(
    database_url: str, db: Database, tmp_path: Path
) -> None:
    settings = {
        "serve_workers": 2,
        "serve_api_processes": 1,
        "env_executor": "process",
        "env_workers": 2,
        "env_plugins": GOOD,
        "max_running_episodes": 4,  # neither worker process claims the whole batch at once
    }
    async with simulated_sglang(latency_seconds=0.05) as (_, sglang_url):
        async with service_process(tmp_path, database_url, sglang_url, "plugins", **settings) as service:
            async with httpx.AsyncClient(base_url=service.url, timeout=10) as http:
                for _ in range(6):  # answered by any of the processes: every one lists both plugins
                    names = {env["name"] for env in (await http.get("/envs")).json()}
                    assert {"plugin/counter", "helpdesk/it-support"} <= names
                ids = []
                for env, split in [("plugin/counter", "train"), ("helpdesk/it-support", "test")]:
                    body = submission(env, split, list(range(6)), batch_id=env.replace("/", "-"))
                    response = await http.post("/episodes", json=body)
                    assert response.status_code == 202, response.text
                    ids.append(response.json()["batch_id"])
            for batch_id in ids:
                episodes = await wait_batch_finished(db, batch_id, 60)
                assert {episode.status for episode in episodes} == {"completed"}, service.log_tail()


async def test_task_split_is_required_unless_the_env_declares_its_training_split(
    plugin_client: httpx.AsyncClient,
) -> None:
    listed = {env["name"]: env for env in (await plugin_client.get("/envs")).json()}
    assert listed["builtin/shop"]["train_split"] is None
    assert listed["helpdesk/it-support"]["train_split"] == "train"

    body = {"env": "builtin/shop", "task_indices": [0]}
    response = await plugin_client.post("/episodes", json=body)
    assert response.status_code == 422
    assert "task_split is required: builtin/shop declares no training split" in response.text, response.text

    response = await plugin_client.post("/episodes", json={"env": "helpdesk/it-support", "task_indices": [7]})
    assert response.status_code == 202, response.text
    batch = (await plugin_client.get(f"/batches/{response.json()['batch_id']}")).json()
    assert batch["task_split"] == "train"


async def test_an_env_that_hangs_fails_at_the_call_timeout(database_url: str) -> None:
    async with plugin_service(database_url, env_call_timeout_seconds=HANG_SECONDS / 2) as client:
        # The first episode starts the env worker process (slow on a busy machine): not timed here.
        await finished_episodes(client, submission("plugin/counter", "train", [0], samples_per_task=1))
        episodes = await finished_episodes(client, submission("plugin/misbehaving", "hang", [0]))
    for episode in episodes:
        assert episode["status"] == "failed"  # infrastructure: not trained on
        assert "TimeoutError" in episode["error"], episode["error"]
        assert f"did not return within {HANG_SECONDS / 2:g} s" in episode["error"]
        assert episode["reward"] is None
