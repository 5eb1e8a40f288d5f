"""OpenEnv remote envs beyond MCP tool envs (service/envs/remote/openenv*.py): a plain reset/step
server's action as the policy's one tool, sessions kept between episodes, a shutdown that ends
every server session, and a dead server named in its episodes' error. Real openenv-core servers
(examples/openenv_counter/server.py), through the whole service on both databases."""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import subprocess
import sys

import httpx
import prometheus_client
import pytest
from prometheus_client import CollectorRegistry
from websockets.asyncio.connection import Connection
from websockets.asyncio.server import ServerConnection
from websockets.asyncio.server import serve as ws_serve
from websockets.exceptions import ConnectionClosed
from websockets.frames import OP_TEXT, Frame
from websockets.streams import StreamReader

from service.app import create_app
from service.call_timeouts import CallTimeouts
from service.envs.base import Action
from service.envs.remote import openenv
from service.envs.remote import pool as pool_module
from service.envs.remote.config import RemoteEnvConfig
from service.envs.remote.openenv import AnswerConnection, SessionClient, close_client, text_frame
from service.envs.remote.openenv_actions import LIST_TOOLS, call_tool_payload
from service.envs.remote.opener import RemoteEnvs
from service.envs.remote.pool import CALL_BUCKETS_SECONDS, SERIES, PoolMetrics, ServerPool
from service.serving import serve_app
from service.sim.policy import SimConfig
from service.sim.worker import SimWorker, create_sim_app, serve_in_thread
from tests.conftest import service_settings
from tests.support.contract import assert_stored_episode_matches_sim
from tests.support.ports import free_port
from tests.support.remote_servers import EnvServer, OpenEnvServers
from tests.test_remote_envs import ENV, counter_oracle, finished_batch, remote_config, wait_closed

GUESS = "remote/guess"


def guess_oracle(prompt_text: str, key: str) -> str:
    """Guesses 1 first (the server answers "higher"), then the middle of the range: reward 1.0."""
    bound = re.search(r"Guess the number between 1 and (\d+)\.", prompt_text)
    assert bound is not None, prompt_text
    guess = int(bound.group(1)) // 2 if "higher" in prompt_text else 1
    return f"<tool_call>\n{json.dumps({'name': 'step', 'arguments': {'guess': guess}})}\n</tool_call>"


@pytest.fixture
def guess_server(openenv_servers: OpenEnvServers) -> EnvServer:
    """The example's plain action env, the session's (tests/conftest.py)."""
    return openenv_servers.guess


@pytest.fixture
def counter_server(openenv_servers: OpenEnvServers) -> EnvServer:
    """One of the session's counter env servers, which tests/test_remote_envs.py uses too."""
    return openenv_servers.counters[0]


def test_the_wire_dicts_are_openenv_cores_types() -> None:
    """The actions built without pydantic on the hot path are what openenv-core's types dump."""
    from openenv.core.env_server.mcp_types import CallToolAction, ListToolsAction

    assert (
        call_tool_payload("add", {"n": 2}) == CallToolAction(tool_name="add", arguments={"n": 2}).model_dump()
    )
    assert LIST_TOOLS == ListToolsAction().model_dump()


async def test_a_plain_action_server_runs_with_its_action_as_one_tool(
    database_url: str, guess_server: EnvServer
) -> None:
    sim = SimWorker(SimConfig(latency_seconds=0.01, policy=guess_oracle))
    config = {"name": GUESS, "protocol": "openenv", "urls": [guess_server.url], "splits": {"train": 20}}
    with serve_in_thread(create_sim_app(sim.config, worker=sim)) as sim_url:
        settings = service_settings(database_url, sim_url, remote_envs=json.dumps([config]))
        async with (
            serve_app(create_app(settings)) as url,
            httpx.AsyncClient(base_url=url, timeout=90) as client,
        ):
            body = {"env": GUESS, "task_split": "train", "task_indices": [0, 3, 5], "max_turns": 4}
            accepted = (await client.post("/episodes", json=body)).json()
            batch = await finished_batch(client, accepted["batch_id"])
            episodes = [(await client.get(f"/episodes/{id_}")).json() for id_ in accepted["episode_ids"]]
    assert batch["counts"]["completed"] == 3, [episode["error"] for episode in episodes]
    for episode in episodes:
        assert episode["reward"] == 1.0
        tools = [(m["name"], m["content"]) for m in episode["messages"] if m["role"] == "tool"]
        assert tools == [("step", "higher"), ("step", "right")]
        assert_stored_episode_matches_sim(sim, episode)


async def test_the_action_tool_comes_from_the_servers_schema(guess_server: EnvServer) -> None:
    config = RemoteEnvConfig(name=GUESS, protocol="openenv", urls=[guess_server.url], splits={"train": 5})
    envs = RemoteEnvs([config], local=None)  # type: ignore[arg-type]
    try:
        session = await envs.open(GUESS, "train", "e0")
        reset = await session.reset(0)
        assert reset.observation == "Guess the number between 1 and 4."
        (tool,) = session.tools
        assert tool["function"]["name"] == "step"
        assert tool["function"]["description"] == "Guess the hidden number."
        parameters = tool["function"]["parameters"]
        assert set(parameters["properties"]) == {"guess"}  # not the base Action's metadata
        assert parameters["required"] == ["guess"]
        wrong = await session.step(Action("submit", {"answer": "2"}))
        assert "unknown tool 'submit'" in wrong.observation and not wrong.done
        right = await session.step(Action("step", {"guess": 2}))
        assert (right.observation, right.reward, right.done) == ("right", 1.0, True)
        await session.close()
    finally:
        await envs.close()


async def test_a_session_is_kept_for_the_servers_next_episode_and_ends_when_idle(
    counter_server: EnvServer,
) -> None:
    await wait_closed([counter_server])  # the server is the session's: it counts every test's sessions
    config = RemoteEnvConfig.model_validate(remote_config([counter_server], reuse_idle_seconds=0.5))
    envs = RemoteEnvs([config], local=None)  # type: ignore[arg-type]
    opened = counter_server.sessions()["opened"]
    try:
        for index in range(3):
            session = await envs.open(ENV, "train", f"e{index}")
            reset = await session.reset(index)
            assert reset.observation == f"Reach {index + 2} with add, then submit it."
            assert (await session.step(Action("add", {"n": 1}))).observation == "1"  # reset: from 0
            await session.close()
        assert counter_server.sessions() == {"active": 1, "opened": opened + 1}  # one session, reused
        # A session left mid-call is never reused.
        session = await envs.open(ENV, "train", "cut")
        await session.reset(0)
        call = asyncio.ensure_future(session.step(Action("slow", {"seconds": 0.3})))
        await asyncio.sleep(0.05)
        call.cancel()
        await session.close()
        assert envs.openenv[ENV].idle.count() == 0
        await wait_closed([counter_server])  # the kept session ended after its idle time
    finally:
        await envs.close()


async def test_a_shutdown_ends_every_session_on_the_servers(
    database_url: str, counter_server: EnvServer
) -> None:
    """Episodes mid-way (waiting on the engine) and sessions kept between episodes: the service's
    shutdown ends them all; the server reports 0 open."""
    sim = SimWorker(SimConfig(latency_seconds=1.0, policy=counter_oracle))
    config = remote_config([counter_server], reuse_idle_seconds=600.0)
    with serve_in_thread(create_sim_app(sim.config, worker=sim)) as sim_url:
        settings = service_settings(
            database_url, sim_url, remote_envs=json.dumps([config]), shutdown_timeout_seconds=0.2
        )
        async with (
            serve_app(create_app(settings)) as url,
            httpx.AsyncClient(base_url=url, timeout=90) as client,
        ):
            body = {"env": ENV, "task_split": "train", "task_indices": list(range(6)), "max_turns": 4}
            (await client.post("/episodes", json=body)).raise_for_status()
            for _ in range(1200):
                if counter_server.sessions()["active"] >= 4:
                    break
                await asyncio.sleep(0.05)
            assert counter_server.sessions()["active"] >= 4
    await wait_closed([counter_server])


@pytest.mark.usefixtures("openenv_client")
async def test_a_dead_servers_episodes_say_which_server_failed_and_how(database_url: str) -> None:
    """A server that is gone (nothing listens at its URL any more) refuses the connection."""
    sim = SimWorker(SimConfig(latency_seconds=0.01, policy=counter_oracle))
    dead = f"http://127.0.0.1:{free_port()}"
    config = {**remote_config([]), "urls": [dead], "reset_retries": 0, "placement_timeout_seconds": 1}
    with serve_in_thread(create_sim_app(sim.config, worker=sim)) as sim_url:
        settings = service_settings(database_url, sim_url, remote_envs=json.dumps([config]), max_attempts=1)
        async with (
            serve_app(create_app(settings)) as url,
            httpx.AsyncClient(base_url=url, timeout=90) as client,
        ):
            body = {"env": ENV, "task_split": "train", "task_indices": [0, 1], "max_turns": 4}
            accepted = (await client.post("/episodes", json=body)).json()
            await finished_batch(client, accepted["batch_id"])
            episodes = [(await client.get(f"/episodes/{id_}")).json() for id_ in accepted["episode_ids"]]
    for episode in episodes:
        assert episode["status"] == "failed" and episode["reward"] is None, episode
        # Placed on the server (it refused) or, once it was out of placement, on none in time.
        error = episode["error"]
        assert error.startswith("env server failed: no server of "), error
        assert re.search(rf"{re.escape(dead)}.*refused the connection during ", error), error


async def healthy(url: str) -> None:
    """A health check that always passes (pools built without servers)."""


async def test_a_freed_slot_goes_to_the_first_waiter_still_waiting() -> None:
    """Placement's queue: one waiter woken per freed slot, in order; a cancelled waiter passes its
    turn on; a server back in placement wakes them all."""

    pool = ServerPool(
        ENV,
        ["http://a"],
        max_sessions_per_server=1,
        health_check=healthy,
        metrics=PoolMetrics(),
        health_interval_seconds=60,
        placement_timeout_seconds=5,
    )
    try:
        (server,) = pool.servers
        assert await pool.acquire() is server
        waiters = [asyncio.ensure_future(pool.acquire()) for _ in range(3)]
        await asyncio.sleep(0)
        waiters[0].cancel()
        await pool.release(server)
        assert await waiters[1] is server and not waiters[2].done()
        pool.mark_down(server, "test")
        await pool.release(server)  # the slot is free, the server is not in placement
        await asyncio.sleep(0.01)
        assert not waiters[2].done()
        await pool.check()  # its health check passes: back, and the waiter placed
        assert await waiters[2] is server and server.sessions == 1
    finally:
        await pool.close()


async def test_a_server_that_answered_since_the_last_round_is_not_probed() -> None:
    """A health check round probes only the servers that answered no call since the last one (a
    call that raised is no answer), and every server out of placement, answered or not."""
    probed: list[str] = []

    async def check(url: str) -> None:
        probed.append(url)

    pool = ServerPool(
        ENV,
        ["http://a", "http://b"],
        max_sessions_per_server=1,
        health_check=check,
        metrics=PoolMetrics(),
        health_interval_seconds=60,
    )
    a, b = pool.servers

    async def round_probes() -> list[str]:
        probed.clear()
        await pool.check()
        return sorted(probed)

    with pool.call(a, "step"):
        pass
    assert await round_probes() == ["http://b"]
    assert await round_probes() == ["http://a", "http://b"]  # no call since
    with pytest.raises(RuntimeError), pool.call(a, "step"):
        raise RuntimeError("no answer")
    async with pool.call(b, "step"):
        pass
    assert await round_probes() == ["http://a"]
    with pytest.raises(TimeoutError):
        async with pool.call(b, "step"):
            raise TimeoutError
    assert await round_probes() == ["http://a", "http://b"]
    pool.mark_down(a, "test")
    with pool.call(a, "step"):  # a session's call answered while the server is out of placement
        pass
    assert await round_probes() == ["http://a", "http://b"]
    assert a.healthy and b.healthy  # its probe brought it back
    a.failed_checks = 2
    with pool.call(a, "step"):
        pass
    await pool.check()
    assert a.failed_checks == 0  # an answer ends a run of failed probes as a passed one does
    await pool.close()


def test_masking_keys_are_fresh_across_the_blocks_they_are_drawn_in() -> None:
    keys = [next(openenv._MASK_KEYS) for _ in range(3 * openenv._MASK_KEYS_DRAWN)]
    assert {len(key) for key in keys} == {4}
    assert len(set(keys)) > 0.99 * len(keys)  # 3,072 draws of 2**32: a repeat or two at most


async def test_the_pools_series_read_as_prometheus_clients_own_metrics_would(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """PoolMetrics reads each server's plain counts at scrape time: its exposition is the one
    prometheus_client's labelled Gauge, Counter and Histogram write for the same calls."""

    registry, reference = CollectorRegistry(), CollectorRegistry()
    pool = ServerPool(
        ENV,
        ["http://a", "http://b"],
        max_sessions_per_server=4,
        health_check=healthy,
        metrics=PoolMetrics(registry),
    )
    theirs = {
        series.name: getattr(prometheus_client, series.type.title())(
            series.name,
            series.documentation,
            series.labels,
            registry=reference,
            **({"buckets": CALL_BUCKETS_SECONDS} if series.type == "histogram" else {}),
        )
        for series in SERIES
    }
    a, b = pool.servers
    calls = [(a, "reset", 0.0004), (a, "step", 0.003), (a, "step", 0.7), (a, "step", 0.01), (b, "open", 90.0)]
    try:
        await pool.acquire()
        await pool.acquire()
        pool.mark_down(b, "test")
        for server, kind, seconds in calls:
            clock = iter((0.0, seconds))  # the call's start and end as the timer reads them
            monkeypatch.setattr(pool_module.time, "perf_counter", lambda clock=clock: next(clock))
            with pool.call(server, kind):
                pass
            monkeypatch.undo()
            theirs["rollout_env_server_calls"].labels(ENV, server.url, kind).inc()
            theirs["rollout_env_server_call_seconds"].labels(ENV, server.url).observe(seconds)
        pool.failed(b, "timeout", "slow")
        pool.failed(b, "timeout", "slow")
        theirs["rollout_env_server_errors"].labels(ENV, b.url, "timeout").inc(2)
        for server in (a, b):
            theirs["rollout_env_server_sessions_open"].labels(ENV, server.url).set(server.sessions)
            theirs["rollout_env_server_up"].labels(ENV, server.url).set(1 if server.healthy else 0)

        def exposition(of: CollectorRegistry) -> list[str]:
            lines = prometheus_client.generate_latest(of).decode().splitlines()
            return [line for line in lines if "_created" not in line]

        ours = exposition(registry)
        assert ours == exposition(reference)
        assert (
            f'rollout_env_server_call_seconds_bucket{{env="{ENV}",le="0.01",server="http://a"}} 3.0' in ours
        )
        assert f'rollout_env_server_up{{env="{ENV}",server="http://b"}} 0.0' in ours
    finally:
        await pool.close()


@pytest.mark.parametrize("length", [0, 5, 125, 126, 65535, 65536, 70_000])
def test_a_text_frame_is_the_one_websockets_serializes(length: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """text_frame (the session's hand-written send) writes what websockets' protocol would for the
    same key, and websockets' own parser on the server side reads it back."""
    payload = bytes(ord("a") + i % 26 for i in range(length))
    key = b"\x01\x02\x03\x04"
    monkeypatch.setattr(openenv, "_MASK_KEYS", iter([key]))
    monkeypatch.setattr(secrets, "token_bytes", lambda n: key)  # websockets' draw
    ours = text_frame(payload)
    assert ours == Frame(OP_TEXT, payload).serialize(mask=True)
    reader = StreamReader()
    reader.feed_data(ours)
    parser = Frame.parse(reader.read_exact, mask=True)
    with pytest.raises(StopIteration) as parsed:
        next(parser)
    frame = parsed.value.value
    assert (frame.opcode, frame.fin, frame.data) == (OP_TEXT, True, payload)


async def test_a_sessions_answers_are_read_in_order_whatever_path_they_take(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """AnswerConnection reads an answer that comes as one whole frame itself, and hands any other
    to websockets' parser (part of a frame, two frames in one read); a message that came while no
    call awaited, or in fragments, is read from websockets' queue, in order; the server's pings are
    answered while a call awaits; a dropped connection fails the awaiting call."""
    parsed: list[bytes] = []  # the client's reads websockets' parser saw
    parse = Connection.data_received

    def counted(connection: Connection, data: bytes) -> None:
        if isinstance(connection, AnswerConnection):
            parsed.append(data)
        parse(connection, data)

    monkeypatch.setattr(Connection, "data_received", counted)
    long = json.dumps({"n": 6, "text": "x" * 300}).encode()

    async def handler(ws: ServerConnection) -> None:
        async for message in ws:
            kind = json.loads(message)["type"]
            if kind == "two":  # an answer, then one more nobody awaits yet
                await ws.send('{"n": 1}')
                await ws.send('{"n": 2}')
            elif kind == "fragments":
                await ws.send(['{"n":', " 3}"])
            elif kind == "ping":
                await asyncio.wait_for(await ws.ping(), 5)  # the client's pong
                await ws.send('{"n": 4}')
            elif kind == "split":  # a frame's header, then its payload, in two reads
                ws.transport.write(b"\x81\x08")
                await asyncio.sleep(0.1)
                ws.transport.write(b'{"n": 5}')
            elif kind == "double":  # two frames in one read
                ws.transport.write(b'\x81\x08{"n": 7}\x81\x08{"n": 8}')
            elif kind == "long":  # a 16-bit length
                await ws.send(long.decode())
            elif kind == "drop":
                ws.transport.abort()

    async with ws_serve(handler, "127.0.0.1", 0) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        client = SessionClient(base_url=f"http://127.0.0.1:{port}", connect_timeout_s=5, message_timeout_s=5)
        client.timeouts = CallTimeouts(5)
        try:
            await client.connect()
            assert isinstance(client._ws, AnswerConnection)
            for kind, answer in (("long", json.loads(long)), ("split", {"n": 5}), ("double", {"n": 7})):
                parsed.clear()
                await client._send({"type": kind})
                assert await client._receive() == answer
                assert len(parsed) == (0 if kind == "long" else 1 if kind == "double" else 2), kind
            assert await client._receive() == {"n": 8}  # the second of the two, queued
            await client._send({"type": "two"})
            assert await client._receive() == {"n": 1}
            await asyncio.sleep(0.2)  # the second arrives with no call awaiting it: queued
            assert client._ws.queued == 1
            assert await client._receive() == {"n": 2}
            assert client._ws.queued == 0
            for kind, n in (("fragments", 3), ("ping", 4), ("two", 1)):
                await client._send({"type": kind})
                assert await client._receive() == {"n": n}
            assert await client._receive() == {"n": 2}  # awaited before it came, or queued: in order
            await client._send({"type": "drop"})
            with pytest.raises(ConnectionClosed):
                await client._receive()
            assert client._ws.answer is None and len(client.timeouts) == 0
        finally:
            client.timeouts.close()
            await close_client(client, 5)


def test_the_openenv_client_is_imported_without_gradio_which_stays_importable() -> None:
    """openenv-core's client would import its web UI (gradio: about 3 s of CPU at every start of a
    service process with an OpenEnv env); gradio stays importable for the rest of the process."""
    check = (
        "import importlib.util, sys\n"
        "import service.envs.remote.openenv as openenv\n"
        "assert 'gradio' not in sys.modules, 'gradio imported'\n"
        "assert importlib.util.find_spec('gradio') is not None\n"  # raises where it is still blocked
        "assert openenv.SessionClient.__mro__[1].__name__ == 'GenericEnvClient'\n"
    )
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
