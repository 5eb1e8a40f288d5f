"""NeMo Gym resource servers as remote envs (service/envs/remote/nemo_gym.py): real servers built with
nemo-gym's own server classes (tests/support/nemo_gym_server.py; PyPI's nemo-gym 0.4.0, NVIDIA-NeMo/Gym
d67ad6611cfe) in nemo-gym's cached virtualenv (scripts/ensure_nemo_gym.sh: its pins conflict with
the project's venv), on free ports; episodes through the whole service on both databases, the
pool's placement, retries and faults."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.app import create_app
from service.envs.base import RESPOND_ACTION_NAME, Action
from service.envs.errors import EnvError
from service.envs.remote.config import RemoteEnvConfig, env_spec, parse_remote_envs
from service.envs.remote.errors import EnvServerDown, EnvServerTimeout
from service.envs.remote.nemo_gym_data import DatasetRows, policy_view
from service.envs.remote.opener import RemoteEnvs
from service.serving import serve_app
from service.sim.policy import SimConfig
from service.sim.worker import SimWorker, create_sim_app, serve_in_thread
from tests.conftest import service_settings
from tests.support.cached_venv import ROOT, ensure_cached_venv
from tests.support.contract import assert_stored_episode_matches_sim
from tests.support.ports import free_port
from tests.support.remote_servers import EnvServer, env_servers
from tests.test_remote_envs import finished_batch

ENV = "remote/nemo-counter"
ENSURE_TIMEOUT_SECONDS = 1800  # a first build installs nemo-gym's requirements (ray, mlflow, ...)
TASKS = 6
TOOL = {"type": "function", "strict": True, "description": ""}
TOOLS = [
    TOOL | {"name": "add", "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}}},
    TOOL | {"name": "read", "parameters": {"type": "object", "properties": {}}},
    TOOL | {"name": "slow", "parameters": {"type": "object", "properties": {"seconds": {"type": "number"}}}},
]


def task_row(index: int) -> dict[str, Any]:
    """A row as nemo-gym's datasets hold them: the policy's input and tools, the verifier's fields."""
    prompt = f"Reach {index + 2} with add, read it, then answer the count."
    return {
        "responses_create_params": {
            "input": [
                {"role": "developer", "content": "Use the counter tools."},
                {"role": "user", "content": [{"type": "input_text", "text": prompt}]},
            ],
            "tools": TOOLS,
        },
        "target": index + 2,
        "start": 0,
    }


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("nemo-gym") / "train.jsonl"
    path.write_text("".join(json.dumps(task_row(index)) + "\n\n" for index in range(TASKS)))
    return path


def counter_oracle(prompt_text: str, key: str) -> str:
    """add(target), read(), then answers the count read: reward 1.0 only if the session's cookies
    carried its count from call to call and to /verify."""
    target = re.search(r"Reach (\d+) with add", prompt_text)
    assert target is not None, prompt_text
    if '<tool_call>\n{"name": "add"' not in prompt_text:
        call = {"name": "add", "arguments": {"n": int(target.group(1))}}
    elif '<tool_call>\n{"name": "read"' not in prompt_text:
        call = {"name": "read", "arguments": {}}
    else:
        counts = re.findall(r'\{"count":(\d+)\}', prompt_text)
        return counts[-1]
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def nemo_config(urls: list[str], dataset: Path, **overrides: Any) -> dict[str, Any]:
    return {
        "name": ENV,
        "protocol": "nemo_gym",
        "urls": urls,
        "datasets": {"train": str(dataset)},
        "train_split": "train",
        "health_interval_seconds": 0.3,
        **overrides,
    }


def remote_envs(urls: list[str], dataset: Path, **overrides: Any) -> RemoteEnvs:
    config = RemoteEnvConfig.model_validate(nemo_config(urls, dataset, **overrides))
    return RemoteEnvs([config], local=None)  # type: ignore[arg-type]


def nemo_servers(count: int) -> Any:
    python = ensure_cached_venv("ensure_nemo_gym.sh", "NeMo Gym", ENSURE_TIMEOUT_SECONDS)["python"]
    command = (python, str(ROOT / "tests" / "support" / "nemo_gym_server.py"))
    return env_servers(count, max_sessions=None, command=command, health="/")


def stats(server: EnvServer) -> dict[str, int]:
    return dict(httpx.get(f"{server.url}/test/stats", timeout=60).json())


@pytest.fixture(scope="module")
def two_servers() -> Iterator[list[EnvServer]]:
    with nemo_servers(2) as servers:
        yield servers


def test_rows_show_the_policy_its_prompt_and_tools_and_the_setting_names_what_is_wrong(
    dataset: Path,
) -> None:
    rows = DatasetRows(str(dataset))
    assert len(rows) == TASKS  # blank lines are not rows
    system, user, tools = policy_view(rows.row(3))
    assert (system, user) == ("Use the counter tools.", "Reach 5 with add, read it, then answer the count.")
    assert tools[0] == {
        "type": "function",
        "function": {"name": "add", "description": "", "parameters": TOOLS[0]["parameters"]},
    }
    assert policy_view({"responses_create_params": {"input": "Hi", "instructions": "Be brief."}}) == (
        "Be brief.",
        "Hi",
        [],
    )
    with pytest.raises(ValueError, match="not a system, developer or user message"):
        policy_view({"responses_create_params": {"input": [{"role": "assistant", "content": "x"}]}})
    with pytest.raises(ValueError, match="not a function tool"):
        policy_view({"responses_create_params": {"input": "x", "tools": [{"type": "web_search"}]}})
    bad = dataset.parent / "bad.jsonl"
    bad.write_text('{"input": "no params"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl row 0 has no responses_create_params"):
        DatasetRows(str(bad)).row(0)

    (config,) = parse_remote_envs(json.dumps([nemo_config(["http://x:1"], dataset)]))
    assert env_spec(config).splits == {"train": TASKS}
    assert env_spec(config).source == "REMOTE_ENVS (nemo_gym)"
    with pytest.raises(ValueError, match="needs datasets"):
        parse_remote_envs(json.dumps([nemo_config(["http://x:1"], dataset, datasets={})]))
    with pytest.raises(ValueError, match="splits are its datasets' rows"):
        parse_remote_envs(json.dumps([nemo_config(["http://x:1"], dataset, splits={"train": 3})]))
    with pytest.raises(ValueError, match="needs urls"):
        parse_remote_envs(json.dumps([nemo_config([], dataset)]))
    (missing,) = parse_remote_envs(json.dumps([nemo_config(["http://x:1"], dataset.parent / "none.jsonl")]))
    with pytest.raises(ValueError, match=r"none\.jsonl' cannot be read"):
        env_spec(missing)


async def test_nemo_gym_episodes_run_end_to_end_on_real_resource_servers(
    database_url: str, two_servers: list[EnvServer], dataset: Path
) -> None:
    before = [stats(server) for server in two_servers]
    sim = SimWorker(SimConfig(latency_seconds=0.01, policy=counter_oracle))
    remote = json.dumps([nemo_config([server.url for server in two_servers], dataset)])
    with serve_in_thread(create_sim_app(sim.config, worker=sim)) as sim_url:
        settings = service_settings(database_url, sim_url, remote_envs=remote)
        async with (
            serve_app(create_app(settings)) as url,
            httpx.AsyncClient(base_url=url, timeout=60) as client,
        ):
            listed = {env["name"]: env for env in (await client.get("/envs")).json()}
            assert listed[ENV]["splits"] == {"train": TASKS}
            assert listed[ENV]["source"] == "REMOTE_ENVS (nemo_gym)"
            body = {"env": ENV, "task_indices": [0, 1, 2, 3], "samples_per_task": 2, "max_turns": 5}
            accepted = (await client.post("/episodes", json=body)).json()
            batch = await finished_batch(client, accepted["batch_id"])
            episodes = [(await client.get(f"/episodes/{id_}")).json() for id_ in accepted["episode_ids"]]
            ready = (await client.get("/ready")).json()
            metrics = (await client.get("/metrics")).text
    assert batch["counts"]["completed"] == 8, [episode["error"] for episode in episodes]
    for episode in episodes:
        target = episode["task_index"] + 2
        assert episode["reward"] == 1.0
        assert episode["messages"][0] == {"role": "system", "content": "Use the counter tools."}
        tools = [(m["name"], json.loads(m["content"])) for m in episode["messages"] if m["role"] == "tool"]
        assert tools == [("add", {"count": target}), ("read", {"count": target})]
        assert_stored_episode_matches_sim(sim, episode)
    # Least-loaded placement spreads the batch over both servers; each episode seeded once and
    # verified once, on its own server.
    assert {episode["info"]["env_server"] for episode in episodes} == {s.url for s in two_servers}
    after = [stats(server) for server in two_servers]
    assert sum(a["seeds"] - b["seeds"] for a, b in zip(after, before, strict=True)) == 8
    assert sum(a["verifies"] - b["verifies"] for a, b in zip(after, before, strict=True)) == 8
    assert set(ready["env_servers"].values()) == {"ok"}
    call = f'env="{ENV}",server="{two_servers[0].url}"'
    assert f'rollout_env_server_calls_total{{call="verify",{call}}}' in metrics
    assert f"rollout_env_server_sessions_open{{{call}}} 0.0" in metrics


async def test_each_session_carries_its_own_cookie_and_a_wrong_answer_earns_a_real_zero(
    two_servers: list[EnvServer], dataset: Path
) -> None:
    envs = remote_envs([two_servers[0].url], dataset)
    try:
        first, second = envs.open(ENV, "train", "e1"), envs.open(ENV, "train", "e2")
        first, second = await first, await second
        reset = await first.reset(0)
        assert reset.observation == "Reach 2 with add, read it, then answer the count."
        assert [tool["function"]["name"] for tool in first.tools] == ["add", "read", "slow"]
        await second.reset(1)
        # Interleaved on one server and one HTTP client: each call counts in its own session.
        assert (await first.step(Action("add", {"n": 2}))).observation == '{"count":2}'
        assert (await second.step(Action("add", {"n": 5}))).observation == '{"count":5}'
        assert (await first.step(Action("read", {}))).observation == '{"count":2}'
        assert (await second.step(Action("read", {}))).observation == '{"count":5}'
        # A tool's error is the tool message (nemo-gym's agent feeds it back the same way).
        invalid = await first.step(Action("add", {"n": "many"}))
        assert '"type":"int_parsing"' in invalid.observation and not invalid.done
        right = await first.step(Action(RESPOND_ACTION_NAME, {"content": "2"}))
        assert (right.reward, right.done) == (1.0, True)
        wrong = await second.step(Action(RESPOND_ACTION_NAME, {"content": "4"}))
        assert (wrong.reward, wrong.done) == (0.0, True)  # the server's verdict, not a failure
        for session in (first, second):
            await session.close()
        assert envs.pools[ENV].servers[0].sessions == 0
    finally:
        await envs.close()


async def test_a_refused_seed_is_retried_on_another_server_and_a_bad_row_aborts(
    two_servers: list[EnvServer], dataset: Path, tmp_path: Path
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    # No health check in between: its probe of the dead server (every 0.3 s in these tests) would
    # restate why it is down ("health check failed") before the reason is read, as under load it did.
    envs = remote_envs(
        [dead, two_servers[1].url], dataset, retry_backoff_seconds=0.01, health_interval_seconds=3600
    )
    try:
        sessions = [await envs.open(ENV, "train", f"e{index}") for index in range(3)]
        for index, session in enumerate(sessions):
            reset = await session.reset(index)
            assert reset.info == {"env_server": two_servers[1].url}
        pool = envs.pools[ENV]
        assert pool.servers[0].errors == {"connect": 1} and pool.servers[0].down is not None
        assert envs.servers()[f"{ENV} {dead}"].startswith("down: connect")
        for session in sessions:
            await session.close()
    finally:
        await envs.close()
    # No server left to try: the error names the server and what failed, as OpenEnv's do.
    envs = remote_envs([dead], dataset, reset_retries=0)
    try:
        session = await envs.open(ENV, "train", "e")
        with pytest.raises(
            EnvServerDown,
            match=rf"^no server of '{ENV}' took the episode after 1 tries; last: "
            rf"{re.escape(dead)} \({ENV}\) refused the connection during seed_session; ",
        ):
            await session.reset(0)
        await session.close()
        assert envs.pools[ENV].servers[0].errors == {"connect": 1}
    finally:
        await envs.close()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"responses_create_params": {"input": [{"role": "tool", "content": "x"}]}}))
    envs = remote_envs([two_servers[1].url], bad)
    try:
        session = await envs.open(ENV, "train", "e")
        with pytest.raises(EnvError, match="not a system, developer or user message") as raised:
            await session.reset(0)
        assert not raised.value.infrastructure  # the env's own data: the episode is aborted
        await session.close()
    finally:
        await envs.close()


async def test_a_timed_out_tool_call_is_not_resent_and_fails_as_infrastructure(
    two_servers: list[EnvServer], dataset: Path
) -> None:
    envs = remote_envs([two_servers[0].url], dataset, call_timeout_seconds=0.5)
    try:
        session = await envs.open(ENV, "train", "e")
        await session.reset(0)
        calls = stats(two_servers[0])["calls"]
        with pytest.raises(
            EnvServerTimeout,
            match=rf"^{re.escape(two_servers[0].url)} \({ENV}\) did not answer within 0\.5 s "
            r"during step 'slow'$",
        ):
            await session.step(Action("slow", {"seconds": 1.5}))
        await session.close()
        await asyncio.sleep(0.5)
        assert stats(two_servers[0])["calls"] == calls + 1  # sent once, never again
        assert envs.pools[ENV].servers[0].errors == {"timeout": 1}
    finally:
        await envs.close()


def kill_mid_episode(servers: list[EnvServer], stop: threading.Event) -> None:
    """Kills servers[0] once an episode has been seeded there and not yet verified."""
    while not stop.is_set():
        seen = stats(servers[0])
        if seen["seeds"] > seen["verifies"]:
            servers[0].kill()
            return
        time.sleep(0.02)


async def test_a_server_killed_mid_batch_reruns_its_episodes_on_the_other(
    database_url: str, dataset: Path, two_servers: list[EnvServer]
) -> None:
    # One server of its own to kill; the episodes rerun on one of the module's (each start imports
    # nemo-gym: about 4 s of CPU).
    with nemo_servers(1) as (doomed,):
        servers = [doomed, two_servers[0]]
        # Slow turns keep episodes open on both servers when one is killed.
        sim = SimWorker(SimConfig(latency_seconds=0.3, policy=counter_oracle))
        remote = json.dumps([nemo_config([server.url for server in servers], dataset)])
        stop = threading.Event()
        killer = threading.Thread(target=kill_mid_episode, args=(servers, stop))
        with serve_in_thread(create_sim_app(sim.config, worker=sim)) as sim_url:
            settings = service_settings(database_url, sim_url, remote_envs=remote)
            async with (
                serve_app(create_app(settings)) as url,
                httpx.AsyncClient(base_url=url, timeout=60) as client,
            ):
                body = {"env": ENV, "task_indices": list(range(TASKS)), "max_turns": 5}
                killer.start()
                accepted = (await client.post("/episodes", json=body)).json()
                batch = await finished_batch(client, accepted["batch_id"])
                stop.set()
                killer.join()
                episodes = [(await client.get(f"/episodes/{id_}")).json() for id_ in accepted["episode_ids"]]
                ready = (await client.get("/ready")).json()
        assert servers[0].process.poll() is not None, "the server was not killed mid-batch"
    # None lost, none stored with reward 0: those on the dead server ran again on the live one.
    assert batch["counts"]["completed"] == TASKS, [episode["error"] for episode in episodes]
    assert [episode["reward"] for episode in episodes] == [1.0] * TASKS
    assert {episode["info"]["env_server"] for episode in episodes} == {servers[1].url}
    assert max(episode["attempt"] for episode in episodes) >= 1
    assert ready["env_servers"][f"{ENV} {servers[0].url}"].startswith("down")
