"""Remote environments (service/envs/remote/): real OpenEnv servers built with openenv-core's own
server code (examples/openenv_counter/server.py) in child processes, reached through openenv-core's
client; episodes through the whole service on both databases, the pool's placement, caps, retries
and faults."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from service.app import create_app
from service.envs.base import RESPOND_ACTION_NAME, Action
from service.envs.remote.config import RemoteEnvConfig, parse_remote_envs
from service.envs.remote.errors import EnvServerDown, EnvServerTimeout
from service.envs.remote.opener import RemoteEnvs
from service.serving import serve_app
from service.sim.policy import SimConfig
from service.sim.worker import SimWorker, create_sim_app, serve_in_thread
from tests.conftest import service_settings
from tests.support.contract import assert_stored_episode_matches_sim
from tests.support.remote_servers import MCP_SERVER, EnvServer, OpenEnvServers, env_servers

ENV = "remote/counter"


def counter_oracle(prompt_text: str, key: str) -> str:
    """Adds the target once, then submits it: reward 1.0."""
    target = re.search(r"Reach (\d+) with add", prompt_text)
    assert target is not None, prompt_text
    added = '<tool_call>\n{"name": "add"' in prompt_text
    name, arguments = (
        ("submit", {"answer": target.group(1)}) if added else ("add", {"n": int(target.group(1))})
    )
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def remote_config(servers: list[EnvServer], **overrides: Any) -> dict[str, Any]:
    return {
        "name": ENV,
        "protocol": "openenv",
        "urls": [server.url for server in servers],
        "splits": {"train": 50, "test": 10},
        "train_split": "train",
        "system_prompt": "Use the tools.",
        "health_interval_seconds": 0.3,
        "reuse_idle_seconds": 1.0,  # kept sessions end soon: the tests wait for 0 open
        **overrides,
    }


async def finished_batch(client: httpx.AsyncClient, batch_id: str) -> dict[str, Any]:
    """The batch once complete (long-polls; a loaded shared machine may take minutes)."""
    for _ in range(6):
        batch: dict[str, Any] = (await client.get(f"/batches/{batch_id}", params={"wait": 30})).json()
        if batch["complete"]:
            break
    return batch


@pytest.fixture
def two_servers(openenv_servers: OpenEnvServers) -> list[EnvServer]:
    """Two counter env servers, the session's (shared with tests/test_remote_openenv.py)."""
    return openenv_servers.counters


async def wait_closed(servers: list[EnvServer]) -> None:
    """Every server reports 0 sessions open (closing is asynchronous on the server's side, and
    sessions kept for reuse end after reuse_idle_seconds). It waits without blocking the event
    loop: the service under test runs on it, and its sweeper ends the kept sessions."""
    live = [server for server in servers if server.process.poll() is None]
    for _ in range(600):
        counts = await asyncio.gather(*(asyncio.to_thread(server.sessions) for server in live))
        if all(count["active"] == 0 for count in counts):
            return
        await asyncio.sleep(0.05)
    raise AssertionError([server.sessions() for server in servers])


def test_the_setting_parses_and_names_what_is_wrong(tmp_path: Any) -> None:
    (config,) = parse_remote_envs(
        json.dumps([{"name": "a/b", "protocol": "openenv", "urls": ["http://x:1"], "splits": {"train": 3}}])
    )
    assert config.max_sessions_per_server == 64 and config.urls == ["http://x:1"]
    path = tmp_path / "envs.yaml"
    path.write_text("- {name: a/b, protocol: openenv, urls: ['http://x:1'], splits: {train: 3}}\n")
    assert parse_remote_envs(str(path)) == [config]
    with pytest.raises(ValueError, match="needs urls"):
        parse_remote_envs('[{"name": "a", "protocol": "openenv", "splits": {}}]')
    with pytest.raises(ValueError, match="splits"):
        parse_remote_envs('[{"name": "a", "protocol": "openenv", "urls": ["http://x"]}]')
    with pytest.raises(ValueError, match="neither a JSON list nor a file"):
        parse_remote_envs("/nowhere.json")


@pytest.fixture
async def service(
    database_url: str, two_servers: list[EnvServer]
) -> AsyncIterator[tuple[SimWorker, httpx.AsyncClient]]:
    sim = SimWorker(SimConfig(latency_seconds=0.01, policy=counter_oracle))
    remote = json.dumps([remote_config(two_servers)])
    with serve_in_thread(create_sim_app(sim.config, worker=sim)) as sim_url:
        settings = service_settings(database_url, sim_url, remote_envs=remote)
        async with (
            serve_app(create_app(settings)) as url,
            httpx.AsyncClient(base_url=url, timeout=90) as http,  # above the long-polls' wait=30
        ):
            yield sim, http


async def test_openenv_episodes_run_end_to_end_and_close_their_sessions(
    service: tuple[SimWorker, httpx.AsyncClient], two_servers: list[EnvServer]
) -> None:
    sim, client = service
    listed = {env["name"]: env for env in (await client.get("/envs")).json()}
    assert listed[ENV]["splits"] == {"train": 50, "test": 10}
    assert listed[ENV]["source"] == "REMOTE_ENVS (openenv)"
    body = {
        "env": ENV,
        "task_split": "test",
        "task_indices": [0, 1, 2, 3],
        "samples_per_task": 2,
        "max_turns": 4,
    }
    accepted = (await client.post("/episodes", json=body)).json()
    batch = await finished_batch(client, accepted["batch_id"])
    episodes = [(await client.get(f"/episodes/{id_}")).json() for id_ in accepted["episode_ids"]]
    assert batch["counts"]["completed"] == 8, [episode["error"] for episode in episodes]
    for episode in episodes:
        assert episode["reward"] == 1.0
        tools = [m for m in episode["messages"] if m["role"] == "tool"]
        target = str(episode["task_index"] + 2)
        assert [(m["name"], m["content"]) for m in tools] == [("add", target), ("submit", "right")]
        assert_stored_episode_matches_sim(sim, episode)
    # Least-loaded placement spreads the batch over both servers.
    assert {episode["info"]["env_server"] for episode in episodes} == {s.url for s in two_servers}
    await wait_closed(two_servers)
    ready = (await client.get("/ready")).json()
    assert set(ready["env_servers"].values()) == {"ok"}
    metrics = (await client.get("/metrics")).text
    assert (
        f'rollout_env_server_calls_total{{call="step",env="{ENV}",server="{two_servers[0].url}"}}' in metrics
    )
    assert 'rollout_env_server_sessions_open{env="remote/counter"' in metrics


async def open_and_reset(envs: RemoteEnvs, index: int) -> Any:
    session = await envs.open(ENV, "train", f"e{index}")
    await session.reset(index)
    return session


async def test_the_cap_holds_sessions_per_server_and_placement_is_least_loaded(
    two_servers: list[EnvServer],
) -> None:
    config = RemoteEnvConfig.model_validate(
        remote_config(two_servers, max_sessions_per_server=2, placement_timeout_seconds=0.5)
    )
    envs = RemoteEnvs([config], local=None)  # type: ignore[arg-type]
    # The servers are the session's (tests/conftest.py): a session an earlier test closed may still be
    # open on its server (a timed-out step runs on after its close), and the counts below are the servers'.
    await wait_closed(two_servers)
    try:
        sessions = [await open_and_reset(envs, index) for index in range(4)]
        assert [s.session.server_url for s in sessions].count(two_servers[0].url) == 2
        assert [server.sessions()["active"] for server in two_servers] == [2, 2]
        # Full: a fifth waits for a slot, and fails as infrastructure when none frees in time.
        with pytest.raises(EnvServerDown, match=r"could take an episode within 0\.5 s"):
            await open_and_reset(envs, 5)
        await sessions[0].close()
        fifth = await open_and_reset(envs, 5)
        assert fifth.session.server_url == sessions[0].session.server_url  # the freed slot
        for session in [*sessions[1:], fifth]:
            await session.close()
        await wait_closed(two_servers)
    finally:
        await envs.close()


async def test_a_timed_out_tool_call_is_not_resent_and_fails_as_infrastructure(
    two_servers: list[EnvServer],
) -> None:
    config = RemoteEnvConfig.model_validate(remote_config(two_servers[:1], call_timeout_seconds=1.0))
    envs = RemoteEnvs([config], local=None)  # type: ignore[arg-type]
    pool = envs.pools[ENV]

    def calls() -> dict[str, float]:
        return {
            sample.labels["call"]: sample.value
            for family in envs.metrics.collect()
            if family.name == "rollout_env_server_calls"
            for sample in family.samples
            if sample.name.endswith("_total")
        }

    try:
        # The open and reset may themselves time out and be retried on a loaded machine (a reset has not
        # taken effect when it times out): the step's own calls and errors are counted from after them.
        session = await open_and_reset(envs, 0)
        assert [tool["function"]["name"] for tool in session.tools] == ["add", "submit", "slow"]
        calls_before, timeouts_before = calls(), pool.servers[0].errors.get("timeout", 0)
        with pytest.raises(
            EnvServerTimeout, match=r"\(remote/counter\) did not answer within 1 s during step 'slow'"
        ):
            await session.step(Action("slow", {"seconds": 3.0}))
        await session.close()
        assert pool.servers[0].errors.get("timeout", 0) - timeouts_before == 1
        sent = {call: count - calls_before.get(call, 0.0) for call, count in calls().items()}
        assert {call: n for call, n in sent.items() if n} == {"step": 1.0}  # sent once, never again
    finally:
        await envs.close()
    # The server ends the session once its 3 s call is over: a test after this one on the same
    # server (in a random-order run) counted it open.
    await wait_closed(two_servers[:1])


async def test_a_plain_answer_ends_the_episode_or_goes_to_the_respond_tool(
    two_servers: list[EnvServer],
) -> None:
    plain = RemoteEnvConfig.model_validate(remote_config(two_servers))
    routed = RemoteEnvConfig.model_validate(
        remote_config(two_servers, name="remote/answer", respond_tool="submit")
    )
    envs = RemoteEnvs([plain, routed], local=None)  # type: ignore[arg-type]
    try:
        session = await open_and_reset(envs, 1)
        step = await session.step(Action(RESPOND_ACTION_NAME, {"content": "3"}))
        assert (step.done, step.reward) == (True, 0.0)
        await session.close()
        answered = await envs.open("remote/answer", "train", "e")
        await answered.reset(1)
        step = await answered.step(Action(RESPOND_ACTION_NAME, {"content": "3"}))
        assert (step.observation, step.done, step.reward) == ("right", True, 1.0)
        await answered.close()
    finally:
        await envs.close()
    await wait_closed(two_servers)


async def test_a_server_killed_mid_batch_fails_its_episodes_as_retryable_and_leaves_placement(
    two_servers: list[EnvServer],
) -> None:
    # One server of its own to kill, beside one of the session's.
    with env_servers(1) as (doomed,):
        servers = [doomed, two_servers[1]]
        config = RemoteEnvConfig.model_validate(remote_config(servers))
        envs = RemoteEnvs([config], local=None)  # type: ignore[arg-type]
        try:
            sessions = [await open_and_reset(envs, index) for index in range(4)]
            on_dead = [s for s in sessions if s.session.server_url == servers[0].url]
            servers[0].kill()
            for session in on_dead:
                with pytest.raises(
                    EnvServerDown,
                    match=rf"{servers[0].url} \({ENV}\) closed the connection \(.*\) during step 'add'",
                ):
                    await session.step(Action("add", {"n": 1}))
            pool = envs.pools[ENV]
            assert pool.servers[0].down is not None
            # New episodes go to the live server only; the dead one is out of placement.
            later = [await open_and_reset(envs, index) for index in range(3)]
            assert {s.session.server_url for s in later} == {servers[1].url}
            assert envs.servers()[f"{ENV} {servers[0].url}"].startswith("down")
            for session in [*sessions, *later]:
                await session.close()
            await wait_closed(servers[1:])
        finally:
            await envs.close()


async def test_a_server_that_comes_back_returns_to_placement(two_servers: list[EnvServer]) -> None:
    config = RemoteEnvConfig.model_validate(remote_config(two_servers))
    envs = RemoteEnvs([config], local=None)  # type: ignore[arg-type]
    try:
        pool = envs.pools[ENV]
        pool.mark_down(pool.servers[0], "test")
        pool.start()
        for _ in range(50):
            if pool.servers[0].down is None:
                break
            await asyncio.sleep(0.1)
        assert pool.servers[0].down is None
    finally:
        await envs.close()


# ---- MCP tool servers (the official SDK's server and client). ----

MCP_ENV = "remote/notebook"


def notebook_oracle(prompt_text: str, key: str) -> str:
    """Writes the word under its key, then answers it: reward 1.0."""
    task = re.search(r"Store (\w+) under (k\d+), then answer", prompt_text)
    assert task is not None, prompt_text
    word, note = task.groups()
    if '<tool_call>\n{"name": "write"' in prompt_text:
        return word
    call = {"name": "write", "arguments": {"key": note, "value": word}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def mcp_config(**where: Any) -> dict[str, Any]:
    return {
        "name": MCP_ENV,
        "protocol": "mcp",
        "splits": {"train": 8},
        "tasks": "tests.support.mcp_server:notebook_tasks",
        **where,
    }


STDIO = [sys.executable, "-m", "tests.support.mcp_server"]


async def test_mcp_stdio_episodes_run_end_to_end(database_url: str) -> None:
    sim = SimWorker(SimConfig(latency_seconds=0.01, policy=notebook_oracle))
    remote = json.dumps([mcp_config(command=STDIO)])
    with serve_in_thread(create_sim_app(sim.config, worker=sim)) as sim_url:
        settings = service_settings(database_url, sim_url, remote_envs=remote)
        async with (
            serve_app(create_app(settings)) as url,
            httpx.AsyncClient(base_url=url, timeout=60) as client,
        ):
            body = {"env": MCP_ENV, "task_split": "train", "task_indices": [0, 1], "samples_per_task": 2}
            accepted = (await client.post("/episodes", json=body | {"max_turns": 4})).json()
            batch = await finished_batch(client, accepted["batch_id"])
            episodes = [(await client.get(f"/episodes/{id_}")).json() for id_ in accepted["episode_ids"]]
            ready = (await client.get("/ready")).json()
            metrics = (await client.get("/metrics")).text
    assert batch["counts"]["completed"] == 4, [episode["error"] for episode in episodes]
    # The MCP pool shows in /ready and /metrics as OpenEnv pools do.
    assert ready["env_servers"] == {f"{MCP_ENV} stdio:{' '.join(STDIO)}": "ok"}
    assert f'rollout_env_server_calls_total{{call="step",env="{MCP_ENV}",server="stdio:' in metrics
    assert f'rollout_env_server_sessions_open{{env="{MCP_ENV}",server="stdio:' in metrics
    for episode in episodes:
        assert episode["reward"] == 1.0
        assert episode["info"]["word"]  # the task plugin's info reaches the trainer's records
        tools = [(m["name"], m["content"]) for m in episode["messages"] if m["role"] == "tool"]
        assert tools == [("write", f"stored k{episode['task_index']}")]
        assert episode["messages"][0]["content"] == "Use the notebook tools, then answer."
        assert_stored_episode_matches_sim(sim, episode)


def test_an_mcp_stdio_command_launches_whatever_stderr_was_when_mcp_was_imported() -> None:
    """The SDK's stdio transport writes the command's stderr to the sys.stderr of when mcp was first
    imported (a default argument): imported under a test's captured output (a stream of no file),
    every later launch in the process failed (UnsupportedOperation: fileno: the stdio test in CI, on a
    worker where an earlier test had imported mcp). In a fresh interpreter: mcp imported under such
    a stream, then a session."""
    check = f"""
import asyncio, io, sys
captured, sys.stderr = sys.stderr, io.StringIO()
import service.envs.remote.mcp_tools  # mcp with it
from service.envs.remote.config import RemoteEnvConfig
from service.envs.remote.opener import RemoteEnvs
sys.stderr = captured

async def main():
    config = RemoteEnvConfig.model_validate({mcp_config(command=STDIO)!r})
    envs = RemoteEnvs([config], local=None)
    try:
        session = await envs.open({MCP_ENV!r}, "train", "e")
        await session.reset(0)
        print(sorted(tool["function"]["name"] for tool in session.tools))
        await session.close()
    finally:
        await envs.close()

asyncio.run(main())
"""
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "'write'" in done.stdout, done.stdout


async def test_mcp_streamable_http_pool_places_calls_and_fails_a_dead_server_as_infrastructure() -> None:
    with env_servers(2, command=tuple(MCP_SERVER), health="/mcp") as servers:
        urls = [f"{server.url}/mcp" for server in servers]
        envs = RemoteEnvs([RemoteEnvConfig.model_validate(mcp_config(urls=urls))], local=None)  # type: ignore[arg-type]
        try:
            first = await envs.open(MCP_ENV, "train", "e1")
            second = await envs.open(MCP_ENV, "train", "e2")
            assert {first.server.url, second.server.url} == set(urls)  # least-loaded
            pool = envs.mcp[MCP_ENV].pool
            await pool.check()  # the health check passes on a live server
            assert [server.failed_checks for server in pool.servers] == [0, 0]
            assert set(envs.servers().values()) == {"ok"}
            assert [tool["function"]["name"] for tool in first.tools] == ["write", "read"]
            reset = await first.reset(2)
            assert reset.observation == "Store stone under k2, then answer stone."
            assert (
                await first.step(Action("write", {"key": "k2", "value": "stone"}))
            ).observation == "stored k2"
            assert (await first.step(Action("read", {"key": "k2"}))).observation == "stone"
            done = await first.step(Action(RESPOND_ACTION_NAME, {"content": "stone"}))
            assert (done.reward, done.done) == (1.0, True)
            await first.close()
            dead = next(server for server in servers if f"{server.url}/mcp" == second.server.url)
            dead.kill()
            await second.reset(0)
            with pytest.raises(EnvServerDown):
                await second.step(Action("read", {"key": "k0"}))
            await second.close()
            assert envs.mcp[MCP_ENV].pool.servers[urls.index(second.server.url)].down is not None
        finally:
            await envs.close()


async def test_mcp_sessions_close_in_any_order_and_shutdown_leaves_no_task_running() -> None:
    """The SDK's transports hold anyio cancel scopes, which must be exited by the task that entered
    them, last in first out: one task closing its first session while a second is open once
    cancelled that task and tore down the second session's transport."""
    before = asyncio.all_tasks()
    with env_servers(1, command=tuple(MCP_SERVER), health="/mcp") as (server,):
        config = mcp_config(urls=[f"{server.url}/mcp"], health_interval_seconds=0.1)
        envs = RemoteEnvs([RemoteEnvConfig.model_validate(config)], local=None)  # type: ignore[arg-type]
        try:
            first = await envs.open(MCP_ENV, "train", "e1")
            second = await envs.open(MCP_ENV, "train", "e2")
            await first.close()
            current = asyncio.current_task()
            assert current is not None and current.cancelling() == 0
            await second.reset(0)
            step = await second.step(Action("write", {"key": "k0", "value": "apple"}))
            assert step.observation == "stored k0"
            third = await envs.open(MCP_ENV, "train", "e3")  # left open, as at a shutdown
            assert (await third.step(Action("read", {"key": "k0"}))).observation == "apple"
            await asyncio.sleep(0.3)  # the pool's health checks have started
        finally:
            await envs.close()  # shutdown: the sessions left open are closed, the checks stopped
        assert envs.mcp[MCP_ENV].pool.servers[0].sessions == 0
        assert asyncio.all_tasks() - before == set()
