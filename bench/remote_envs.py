"""Remote environments: episodes in flight against a pool of 2 real OpenEnv servers on loopback
(examples/openenv_counter/server.py, openenv-core's own server code), through RemoteEnvs as the
episode runner uses it, against the same env in this service's env workers (EnvHost) as baseline.

Each episode: open + reset (the server lists its tools), `add`, `submit` (reward 1.0), close:
three env calls as the runner counts them (reset, two steps). Episodes run as the service's worker
runs them: --episodes in flight (default 2,000), each finished one replaced by the next. A first
round of that many opens a server session (a WebSocket connection and its handshake) per episode
in flight: a job pays it once per session slot, and later episodes reset the sessions their
server's earlier episodes left (REMOTE_ENVS' reuse_idle_seconds). So each run measures that first
round apart (`first_round`) and then --rounds times as many episodes (the steady state of a job
that keeps its episodes in flight for hours), for the remote env and the baselines alike. The
service's garbage-collector tuning (app.tune_garbage_collector, on by default) is applied first.
Reported:
- `remote`: errors, sessions the servers still hold at the end (0 expected), this process's CPU
  per env call (`first_round` within);
- `baseline_thread` / `baseline_process`: the same episodes against the same env logic run by
  EnvHost (thread executor: the env's own CPU counted here; process executor: in its workers);
- `baseline_bare_client`: the same episodes through openenv-core's own client (GenericEnvClient,
  a WebSocket session each, kept between episodes as RemoteEnvs keeps its): what the protocol
  costs any client of it in this process, the floor under `remote`;
- `cpu_ratio_vs_*`: the steady state's ratio, the goal's; `first_round_cpu_ratio_vs_*`: the first
  round's; null where either run had errors (its CPU is not that of the same episodes);
- `overhead`: sequential steps on one session, p50 through RemoteEnvs vs openenv-core's bare
  client on the same server (what this layer adds per call), and vs the server's own handler
  time per message (the example server's middleware: receipt to answer), goal <= 2 ms;
- `kill`: last, on the same servers, a batch with one server killed mid-way; episodes that fail as
  infrastructure are re-run (as the worker does within its attempt budget) and must all complete
  with reward 1.0.
`--profile FILE [--profiler perf]` records the remote env's steady state (bench.profiles).
Run from the repo root: .venv/bin/python bench/remote_envs.py [--episodes N] [--rounds R] [--quick]
    [--profile FILE [--profiler perf]]
Everything runs on uvloop where it is installed, as `python -m service serve` does (uvicorn's
default). The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from openenv.core.env_server.mcp_types import CallToolAction
from openenv.core.generic_client import GenericEnvClient

from bench import profiles
from bench.common import percentiles_ms, run_loop
from bench.profiles import Profile, profiling
from service.app import tune_garbage_collector
from service.envs.base import Action, EnvSpec
from service.envs.host import EnvHost
from service.envs.remote.config import RemoteEnvConfig
from service.envs.remote.errors import EnvServerDown
from service.envs.remote.opener import RemoteEnvs
from tests.support.counter_env import local_counter
from tests.support.remote_servers import EnvServer, env_servers

ENV = "remote/counter"
CALLS_PER_EPISODE = 3  # reset, add, submit
MAX_ATTEMPTS = 3  # the worker's attempt budget (MAX_FAILED_ATTEMPTS) in the kill run


async def episode(envs: Any, index: int, added: asyncio.Queue[int] | None = None) -> float:
    session = await envs.open(ENV, "train", f"e{index}")
    try:
        await session.reset(index)
        await session.step(Action("add", {"n": index + 2}))
        if added is not None:  # the kill run: hold the session open until the kill
            added.put_nowait(index)
            await asyncio.sleep(1.0)
        step = await session.step(Action("submit", {"answer": str(index + 2)}))
        return float(step.reward)
    finally:
        await session.close()


async def run_batch(envs: Any, in_flight: int, rounds: int = 1) -> dict[str, Any]:
    """`in_flight` episodes at a time, `in_flight * rounds` in all."""
    episodes = in_flight * rounds
    slots = asyncio.Semaphore(in_flight)

    async def slotted(index: int) -> float:
        async with slots:
            return await episode(envs, index)

    cpu, wall = time.process_time(), time.perf_counter()
    results = await asyncio.gather(*(slotted(i) for i in range(episodes)), return_exceptions=True)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    errors = [r for r in results if isinstance(r, BaseException)]
    return {
        "in_flight": in_flight,
        "episodes": episodes,
        "errors": len(errors),
        "first_error": repr(errors[0]) if errors else None,
        "rewards_1": sum(1 for r in results if r == 1.0),
        "wall_seconds": round(wall, 3),
        "cpu_ms_per_env_call": round(1000 * cpu / (episodes * CALLS_PER_EPISODE), 4),
    }


def remote_config(servers: list[EnvServer], cap: int) -> RemoteEnvConfig:
    return RemoteEnvConfig(
        name=ENV,
        protocol="openenv",
        urls=[server.url for server in servers],
        splits={"train": 100_000},
        max_sessions_per_server=cap,
        connect_timeout_seconds=60,
        call_timeout_seconds=120,
        placement_timeout_seconds=300,
        health_interval_seconds=0.5,
    )


async def remote_run(
    servers: list[EnvServer], episodes: int, rounds: int, profile: Profile | None = None
) -> dict[str, Any]:
    envs = RemoteEnvs([remote_config(servers, episodes)], local=None)  # type: ignore[arg-type]
    try:
        opened = sum(s.sessions()["opened"] for s in servers)
        first_round = await run_batch(envs, episodes)
        first_round["server_sessions_opened"] = sum(s.sessions()["opened"] for s in servers) - opened
        opened = sum(s.sessions()["opened"] for s in servers)
        with profiling(os.getpid(), profile):
            result = await run_batch(envs, episodes, rounds)
        result["server_sessions_opened"] = sum(s.sessions()["opened"] for s in servers) - opened
        result["first_round"] = first_round
    finally:
        await envs.close()
    await asyncio.sleep(0.5)
    result["sessions_open_on_servers_after"] = sum(s.sessions()["active"] for s in servers)
    return result


async def baseline_run(executor: str, episodes: int, rounds: int) -> dict[str, Any]:
    spec = EnvSpec(name=ENV, splits={"train": 100_000}, description="", factory=local_counter)
    host = EnvHost(1, executor, envs={ENV: spec})  # type: ignore[arg-type]
    try:
        await host.worker_pids()  # started before the clock
        first_round = await run_batch(host, episodes)
        return await run_batch(host, episodes, rounds) | {"first_round": first_round}
    finally:
        await host.close()


class BareClients:
    """openenv-core's client in `episode`'s place: a session (one GenericEnvClient) per episode in
    flight, opened on the servers in turn and kept for the next episode."""

    def __init__(self, servers: list[EnvServer]) -> None:
        self.urls = [server.url for server in servers]
        self.idle: list[GenericEnvClient] = []
        self.opened: list[GenericEnvClient] = []

    async def open(self, env: str, split: str, key: str) -> BareSession:
        if not self.idle:
            client = GenericEnvClient(base_url=self.urls[len(self.opened) % len(self.urls)])
            self.opened.append(client)
            self.idle.append(client)
        return BareSession(self, self.idle.pop())

    async def close(self) -> None:
        await asyncio.gather(*(client.close() for client in self.opened))


class BareSession:
    def __init__(self, clients: BareClients, client: GenericEnvClient) -> None:
        self.clients, self.client = clients, client

    async def reset(self, index: int) -> None:
        await self.client.reset(task_index=index)

    async def step(self, action: Action) -> Any:
        return await self.client.step(CallToolAction(tool_name=action.name, arguments=action.kwargs))

    async def close(self) -> None:
        self.clients.idle.append(self.client)


async def bare_run(servers: list[EnvServer], episodes: int, rounds: int) -> dict[str, Any]:
    clients = BareClients(servers)
    try:
        first_round = await run_batch(clients, episodes)
        return await run_batch(clients, episodes, rounds) | {"first_round": first_round}
    finally:
        await clients.close()


async def overhead(server: EnvServer, steps: int) -> dict[str, Any]:
    envs = RemoteEnvs([remote_config([server], 4)], local=None)  # type: ignore[arg-type]
    ours: list[float] = []
    bare: list[float] = []
    server.handler_ms(clear=True)
    try:
        session = await envs.open(ENV, "train", "overhead")
        await session.reset(0)
        client = GenericEnvClient(base_url=server.url)
        await client.reset(task_index=0)
        for _ in range(steps):
            started = time.perf_counter()
            await session.step(Action("add", {"n": 1}))
            ours.append(time.perf_counter() - started)
            started = time.perf_counter()
            await client.step(CallToolAction(tool_name="add", arguments={"n": 1}))
            bare.append(time.perf_counter() - started)
        await client.close()
        await session.close()
    finally:
        await envs.close()
    ours_ms, bare_ms = percentiles_ms(ours), percentiles_ms(bare)
    # Both clients' steps hit the same handler: its times (the resets' too, a few) are one sample.
    handler_ms = percentiles_ms([ms / 1000 for ms in server.handler_ms()])
    return {
        "steps": steps,
        "remote_envs_ms": ours_ms,
        "bare_openenv_client_ms": bare_ms,
        "server_handler_ms": handler_ms,
        "p50_added_ms": round(ours_ms["p50_ms"] - bare_ms["p50_ms"], 3),
        "p50_above_server_handler_ms": round(ours_ms["p50_ms"] - handler_ms["p50_ms"], 3),
    }


async def kill_run(servers: list[EnvServer], episodes: int) -> dict[str, Any]:
    envs = RemoteEnvs([remote_config(servers, episodes)], local=None)  # type: ignore[arg-type]
    reruns = 0
    lost = 0
    added: asyncio.Queue[int] = asyncio.Queue()

    async def with_attempts(index: int) -> float:
        nonlocal reruns, lost
        for attempt in range(MAX_ATTEMPTS):
            try:
                return await episode(envs, index, added)
            except EnvServerDown:
                reruns += attempt + 1 < MAX_ATTEMPTS
        lost += 1
        return -1.0

    try:
        batch = asyncio.gather(*(with_attempts(i) for i in range(episodes)))
        for _ in range(episodes // 2):  # half the batch is mid-episode (reset, one tool call)
            await added.get()
        placed = [s.sessions for s in envs.pools[ENV].servers]
        servers[0].kill()
        rewards = await batch
    finally:
        await envs.close()
    await asyncio.sleep(0.5)
    return {
        "episodes": episodes,
        "sessions_per_server_at_kill": placed,
        "completed": sum(1 for r in rewards if r >= 0),
        "reward_1": sum(1 for r in rewards if r == 1.0),
        "reward_0": sum(1 for r in rewards if r == 0.0),
        "reruns": reruns,
        "lost": lost,
        "sessions_open_on_live_server_after": servers[1].sessions()["active"],
    }


async def main_async(
    episodes: int, rounds: int, kill_episodes: int, steps: int, profile: Profile | None = None
) -> dict[str, Any]:
    # One pair of servers for every run (each server's start imports openenv-core and gradio: seconds
    # of CPU), the kill run last.
    with env_servers(2, max_sessions=max(episodes, kill_episodes)) as servers:
        report: dict[str, Any] = {"servers": 2, "load_average_at_start": list(os.getloadavg())}
        report["remote"] = await remote_run(servers, episodes, rounds, profile)
        report["baseline_thread"] = await baseline_run("thread", episodes, rounds)
        report["baseline_process"] = await baseline_run("process", episodes, rounds)
        report["baseline_bare_client"] = await bare_run(servers, episodes, rounds)
        report["overhead"] = await overhead(servers[1], steps)
        report["kill"] = await kill_run(servers, kill_episodes)
    for prefix, part in (("", None), ("first_round_", "first_round")):
        runs = {
            name: report[name][part] if part else report[name]
            for name in ("remote", "baseline_thread", "baseline_process", "baseline_bare_client")
        }
        for baseline in ("thread", "process", "bare_client"):
            against = runs[f"baseline_{baseline}"]
            # A run whose episodes failed measured something else: no ratio. (At load 9, openenv-core's
            # client, with its keepalive pings, lost every session to a ping timeout in the first
            # round, and then failed the next 4,000 episodes in 0.9 s.)
            ratio = None
            if not (runs["remote"]["errors"] or against["errors"]):
                ratio = round(runs["remote"]["cpu_ms_per_env_call"] / against["cpu_ms_per_env_call"], 3)
            report[f"{prefix}cpu_ratio_vs_{baseline}"] = ratio
    report["load_average_at_end"] = list(os.getloadavg())
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--episodes", type=int, default=2000, help="episodes in flight")
    parser.add_argument("--rounds", type=int, default=2, help="episodes run = episodes in flight * rounds")
    parser.add_argument("--kill-episodes", type=int, default=400)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--quick", action="store_true", help="a tiny run (tests/test_bench_smoke.py)")
    profiles.add_arguments(parser, "the remote env's steady state, to FILE (py-spy: the GIL holder)")
    args = parser.parse_args(argv)
    if args.quick:
        args.episodes, args.kill_episodes, args.steps = 20, 10, 20
    else:  # process-wide: not in the smoke test, which runs in the suite's process
        tune_garbage_collector()
    # On uvloop, as `python -m service serve` runs (uvicorn's default); the baselines too.
    profile = profiles.from_arguments(args)
    report = run_loop(main_async(args.episodes, args.rounds, args.kill_episodes, args.steps, profile))
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
