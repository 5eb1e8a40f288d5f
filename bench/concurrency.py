"""Thousands of concurrent episodes (builtin/shop, or `--env`) through the real service against a slow engine.

The simulated SGLang worker runs in its own process (`python -m service sim-worker`) with a fixed
latency per /generate, so every turn costs at least that latency. The service runs in this
process (create_app with its worker, SQLite in a temp dir) and gets one batch of N episodes.
Ideal: all N run in parallel and each turn costs exactly the latency, so the batch takes
max(turns) x latency. Measured: wall time, episodes/s and turns/s against that ideal, and the
event-loop lag of the service's loop (a probe coroutine sleeps 10 ms in a loop and records the
overshoot), against the same probe on the idle loop before the service starts.

Run from the repo root:
    .venv/bin/python bench/concurrency.py [--episodes 2000] [--latency 0.5] [--env-executor thread]
        [--env helpdesk/it-support --split train] [--baseline-env builtin/shop --baseline-split test]
With --baseline-env, the baseline runs first, then --env, each on a fresh database, and the JSON
holds both and the ratio of their service CPU per turn (a plugin env against builtin/shop, say).
The simulated worker plays builtin/shop's oracle, and any other env with its generic policy.
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import logging
import os
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import aiohttp  # noqa: E402
import httpx  # noqa: E402

from bench import profiles  # noqa: E402
from bench.common import (  # noqa: E402
    SHOP_TEST_TASKS,
    HealthProbe,
    cpu_seconds_of,
    fresh_database,
    percentiles_ms,
    run_loop,
    sim_worker,
)
from bench.profiles import Profile, profiling  # noqa: E402
from service.app import create_app  # noqa: E402
from service.config import Settings  # noqa: E402
from service.engine.transport import Reply, SocketTransport  # noqa: E402
from service.records import rid_attempt_key  # noqa: E402
from service.serving import serve_app  # noqa: E402

PROBE_INTERVAL = 0.010
T = TypeVar("T")
JSON = {"content-type": "application/json"}
IDLE_PROBE_SECONDS = 2.0


def children_cpu_seconds(pid: int, exclude: int) -> float:
    """CPU seconds of the live child processes of `pid` (the env worker pool), but `exclude`."""
    total = 0.0
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            children = [int(child) for child in task.read_text().split()]
            total += sum(cpu_seconds_of(child) for child in children if child != exclude)
        except OSError:
            continue
    return total


class _LeaseCounter(logging.Handler):
    """Counts the worker's lost-lease warnings (an overloaded loop renews leases too late)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lost = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "lost" in record.getMessage() and "lease" in record.getMessage():
            self.lost += 1


BARE_ATTEMPTS = 6  # the bare client's tries of one call (the simulated worker resets some when loaded)
BARE_BACKOFF_SECONDS = 0.1  # before its second try; doubles


class GenerateRecorder:
    """Keeps every /generate body the service sends, by episode, for the bare-client baseline."""

    def __init__(self) -> None:
        self.bodies: dict[str, list[bytes]] = defaultdict(list)
        self._post: Any = None

    def install(self) -> None:
        self._post = original = SocketTransport.post
        bodies = self.bodies

        async def post(
            transport: SocketTransport,
            url: str,
            body: bytes,
            timeout: float,
            headers: dict[str, str] | None = None,
        ) -> Reply:
            rid = body[body.rindex(b'"rid":"') + 7 : body.rindex(b'"')].decode()  # the body's last field
            bodies[rid_attempt_key(rid)].append(body)
            return await original(transport, url, body, timeout, headers)

        SocketTransport.post = post  # type: ignore[method-assign]

    def uninstall(self) -> None:
        if self._post is not None:
            SocketTransport.post = self._post  # type: ignore[method-assign]


async def bare_client_baseline(url: str, bodies: dict[str, list[bytes]]) -> dict[str, float]:
    """The same bodies, each episode's in order, all episodes at once, from one plain aiohttp
    session: what the HTTP calls alone cost this process."""
    retries = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=len(bodies) or 1)) as session:

        async def replay(episode: list[bytes]) -> None:
            nonlocal retries
            for body in episode:
                # A new rid: the service's requests of that rid are long finished, but be safe.
                for attempt in range(BARE_ATTEMPTS):
                    try:
                        async with session.post(
                            f"{url}/generate", data=body.replace(b'"rid":"', b'"rid":"bare-'), headers=JSON
                        ) as response:
                            await response.read()
                        break
                    # A reset or a dropped connection under 2,000 new connections at once.
                    except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
                        if attempt == BARE_ATTEMPTS - 1:
                            raise
                        retries += 1
                        await asyncio.sleep(BARE_BACKOFF_SECONDS * 2**attempt)

        cpu0, started = time.process_time(), time.perf_counter()
        await asyncio.gather(*(replay(episode) for episode in bodies.values()))
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - started
    calls = sum(len(episode) for episode in bodies.values())
    return {
        "calls": calls,
        "cpu_s": cpu,
        "wall_s": wall,
        "cpu_ms_per_call": 1e3 * cpu / max(calls, 1),
        "retries": retries,
    }


class LagProbe:
    """Sleeps PROBE_INTERVAL in a loop on the running loop and records how late it wakes up."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await asyncio.sleep(PROBE_INTERVAL)
            self.samples.append(max(0.0, loop.time() - started - PROBE_INTERVAL))

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> dict[str, float]:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        return percentiles_ms(self.samples)


async def _run(
    *,
    episodes: int,
    latency: float,
    sim_url: str,
    sim_pid: int,
    database_url: str,
    executor: str,
    workers: int,
    max_inflight: int,
    max_wall: float,
    env: str,
    split: str,
    profile: Profile | None,
) -> dict[str, Any]:
    idle = LagProbe()
    idle.start()
    await asyncio.sleep(IDLE_PROBE_SECONDS)
    idle_stats = await idle.stop()

    settings = Settings(
        database_url=database_url,
        sglang_url=sim_url,
        api_keys="",
        run_worker=True,
        env_executor=executor,
        env_workers=workers,
        max_running_episodes=max(episodes, 2048),
        max_inflight_generates=max_inflight,
        log_level="WARNING",
        shutdown_timeout_seconds=0,  # at the deadline, cancel what still runs
    )
    recorder = GenerateRecorder()
    recorder.install()
    async with serve_app(create_app(settings)) as url, httpx.AsyncClient(base_url=url, timeout=600) as client:
        split_sizes = {listed["name"]: listed["splits"] for listed in (await client.get("/envs")).json()}
        size = split_sizes[env][split] if env != "builtin/shop" else SHOP_TEST_TASKS
        samples = max(1, episodes // min(episodes, size))
        tasks = min(episodes, size)
        total = tasks * samples
        with profiling(os.getpid(), profile, ("--gil", "--idle", "--threads")):
            probe = LagProbe()
            probe.start()
            cpu0, sim_cpu0, env_cpu0 = (
                time.process_time(),
                cpu_seconds_of(sim_pid),
                children_cpu_seconds(os.getpid(), sim_pid),
            )
            # On its own thread, whose CPU is taken out of the process's: the probe is not the service.
            health = HealthProbe(url)
            health.start()
            started = time.perf_counter()
            response = await client.post(
                "/episodes",
                json={
                    "env": env,
                    "task_split": split,
                    "task_indices": list(range(tasks)),
                    "samples_per_task": samples,
                    "sampling_params": {"temperature": 1.0, "max_new_tokens": 256},
                    "max_turns": 12,
                },
            )
            response.raise_for_status()
            batch_id = response.json()["batch_id"]
            submitted = time.perf_counter() - started
            poll_errors: Counter[str] = Counter()
            batch: dict[str, Any] = {"complete": False, "finished": 0, "counts": {}, "episodes": []}
            while True:
                remaining = max_wall - (time.perf_counter() - started)
                wait = max(0.1, min(5.0, remaining))
                try:
                    polled = await client.get(f"/batches/{batch_id}", params={"wait": wait})
                except httpx.HTTPError as error:
                    poll_errors[type(error).__name__] += 1
                else:
                    if polled.status_code == 200:
                        batch = polled.json()
                    else:
                        poll_errors[f"HTTP {polled.status_code}"] += 1
                if batch["complete"] or time.perf_counter() - started >= max_wall:
                    break
            wall = time.perf_counter() - started
            env_cpu = children_cpu_seconds(os.getpid(), sim_pid) - env_cpu0
            health_stats = await asyncio.to_thread(health.stats)
            service_cpu = time.process_time() - cpu0 - health.cpu_seconds
            sim_cpu = cpu_seconds_of(sim_pid) - sim_cpu0
            loop_stats = await probe.stop()
    recorder.uninstall()
    baseline = await bare_client_baseline(sim_url, recorder.bodies)
    generate_calls = sum(len(bodies) for bodies in recorder.bodies.values())

    statuses = {status: count for status, count in batch["counts"].items() if count}
    finished = int(batch["finished"])
    # Episodes of complete groups only (a group is listed once all its samples ended).
    turns = [episode["num_turns"] or 0 for episode in batch["episodes"]]
    attempts = Counter(episode["attempt"] for episode in batch["episodes"])
    total_turns = sum(turns)
    max_turns = max(turns, default=0)
    ideal_wall = max_turns * latency
    return {
        "env": env,
        "task_split": split,
        "episodes": total,
        "finished": finished,
        "complete": bool(batch["complete"]),
        "max_wall_s": max_wall,
        "latency_s": latency,
        "env_executor": executor,
        "env_workers": workers,
        "max_inflight_generates": max_inflight,
        "wall_s": round(wall, 3),
        "submit_s": round(submitted, 3),
        "episodes_per_s": round(finished / wall, 2),
        "ideal_wall_s": round(ideal_wall, 3),
        "ideal_episodes_per_s": round(total / ideal_wall, 2) if ideal_wall else None,
        # Achieved episodes/s over ideal episodes/s (= ideal wall / wall when the batch completed).
        "efficiency": round((finished / wall) / (total / ideal_wall), 4) if ideal_wall else None,
        "turns": total_turns,
        "turns_per_s": round(total_turns / wall, 2),  # turns of listed (complete-group) episodes
        "ideal_turns_per_s": round(total_turns / ideal_wall, 2) if ideal_wall else None,
        "mean_turns": round(total_turns / max(len(turns), 1), 2),
        "max_turns": max_turns,
        "loop_lag_p50_ms": loop_stats["p50_ms"],
        "loop_lag_p99_ms": loop_stats["p99_ms"],
        "loop_lag_max_ms": loop_stats["max_ms"],
        "idle_loop_lag_p50_ms": idle_stats["p50_ms"],
        "idle_loop_lag_p99_ms": idle_stats["p99_ms"],
        "idle_loop_lag_max_ms": idle_stats["max_ms"],
        "loop_lag_p99_ratio": round(loop_stats["p99_ms"] / max(idle_stats["p99_ms"], 0.01), 1),
        "service_cpu_s": round(service_cpu, 2),
        "generate_calls": generate_calls,
        "service_cpu_ms_per_turn": round(1e3 * service_cpu / max(generate_calls, 1), 3),
        "bare_client_cpu_ms_per_call": round(baseline["cpu_ms_per_call"], 3),
        "bare_client_wall_s": round(baseline["wall_s"], 3),
        "bare_client_retries": baseline["retries"],
        "cpu_ratio_to_bare_client": round(
            service_cpu / max(generate_calls, 1) / max(baseline["cpu_ms_per_call"] / 1e3, 1e-9), 2
        ),
        **health_stats,
        "env_workers_cpu_s": round(env_cpu, 2),
        "sim_cpu_s": round(sim_cpu, 2),
        "cpus": os.cpu_count(),
        "statuses": statuses,
        "poll_errors": dict(poll_errors),
        "attempts": {str(key): value for key, value in sorted(attempts.items())},
    }


def run_bench(
    episodes: int = 2000,
    latency: float = 0.5,
    executor: str = "thread",
    workers: int = 2,
    max_inflight: int | None = None,
    max_wall: float = 80.0,
    database: str = "sqlite",
    env: str = "builtin/shop",
    split: str = "test",
    profile: Profile | None = None,
) -> dict[str, Any]:
    logging.getLogger().setLevel(logging.WARNING)
    counter = _LeaseCounter()
    worker_logger = logging.getLogger("service.worker.worker")
    worker_logger.addHandler(counter)
    worker_logger.propagate = False
    thresholds = gc.get_threshold()
    try:
        result = _run_bench(
            episodes,
            latency,
            executor,
            workers,
            max_inflight or max(episodes, 2048),
            max_wall,
            database,
            env,
            split,
            profile,
        )
        result["lost_lease_warnings"] = counter.lost
        return result
    finally:
        gc.unfreeze()  # the service froze the heap (Settings.tune_gc); this process goes on
        gc.set_threshold(*thresholds)
        worker_logger.removeHandler(counter)
        worker_logger.propagate = True


def _run_bench(
    episodes: int,
    latency: float,
    executor: str,
    workers: int,
    max_inflight: int,
    max_wall: float,
    database: str,
    env: str,
    split: str,
    profile: Profile | None,
) -> dict[str, Any]:
    with (
        tempfile.TemporaryDirectory(prefix="bench-concurrency-") as tmp,
        fresh_database(database, Path(tmp), migrate=True) as database_url,
        # Its prefix cache off: the worker shares the cores with the service, whose CPU is measured.
        sim_worker(latency, Path(tmp), ("--prefix-cache-tokens", "0")) as (sim_url, sim_pid),
    ):
        result = run_loop(
            _run(
                episodes=episodes,
                latency=latency,
                sim_url=sim_url,
                sim_pid=sim_pid,
                database_url=database_url,
                executor=executor,
                workers=workers,
                max_inflight=max_inflight,
                max_wall=max_wall,
                env=env,
                split=split,
                profile=profile,
            )
        )
        result["database"] = database
        return result


def _figure(value: float | None, spec: str) -> str:
    """`value` formatted, or n/a: the ideal figures need a listed turn (none before a deadline that
    ended every group early)."""
    return "n/a" if value is None else format(value, spec)


def report(r: dict[str, Any]) -> str:
    done = (
        ""
        if r["complete"]
        else (f"DEADLINE: only {r['finished']} of {r['episodes']} finished within {r['max_wall_s']:.0f} s; ")
    )
    return "\n".join(
        [
            done + f"{r['episodes']} episodes of {r['env']} ({r['task_split']}), "
            f"engine latency {r['latency_s']} s per generate, "
            f"env executor {r['env_executor']} x {r['env_workers']}, {r['cpus']} CPUs, "
            f"max_inflight_generates {r['max_inflight_generates']}, {r['database']}",
            f"wall      {r['wall_s']:.2f} s (ideal {r['ideal_wall_s']:.2f} s = {r['max_turns']} turns x "
            f"latency); efficiency {_figure(r['efficiency'], '.1%')}",
            f"rate      {r['episodes_per_s']:.1f} episodes/s "
            f"(ideal {_figure(r['ideal_episodes_per_s'], '.1f')}), "
            f"{r['turns_per_s']:.1f} turns/s (ideal {_figure(r['ideal_turns_per_s'], '.1f')}); "
            f"{r['mean_turns']:.2f} turns per episode",
            f"loop lag  p50 {r['loop_lag_p50_ms']:.1f} ms, p99 {r['loop_lag_p99_ms']:.1f} ms, max "
            f"{r['loop_lag_max_ms']:.1f} ms (idle: p50 {r['idle_loop_lag_p50_ms']:.2f}, p99 "
            f"{r['idle_loop_lag_p99_ms']:.2f}, max {r['idle_loop_lag_max_ms']:.2f})",
            f"CPU       service {r['service_cpu_s']:.1f} s, env workers {r['env_workers_cpu_s']:.1f} s, "
            f"sim worker {r['sim_cpu_s']:.1f} s over {r['wall_s']:.1f} s wall",
            f"per turn  service {r['service_cpu_ms_per_turn']:.3f} ms CPU; a bare aiohttp client sending the "
            f"same {r['generate_calls']} bodies: {r['bare_client_cpu_ms_per_call']:.3f} ms per call "
            f"({r['cpu_ratio_to_bare_client']:.1f}x)",
            f"/health   p50 {r['health_p50_ms']:.1f} ms, p99 {r['health_p99_ms']:.1f} ms, max "
            f"{r['health_max_ms']:.1f} ms over {r['health_probes']} probes; errors {r['health_errors']}",
            f"statuses  {r['statuses']}; attempts {r['attempts']}; "
            f"lost-lease warnings {r['lost_lease_warnings']}; GET /batches errors {r['poll_errors']}",
        ]
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--episodes", type=int, default=2000)
    parser.add_argument("--latency", type=float, default=0.5)
    parser.add_argument("--env-executor", choices=["thread", "process"], default="thread")
    parser.add_argument("--env-workers", type=int, default=2)
    parser.add_argument(
        "--max-inflight",
        type=int,
        default=None,
        help="Settings.max_inflight_generates (default: max(episodes, 2048))",
    )
    parser.add_argument("--database", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--max-wall", type=float, default=80.0, help="stop waiting after this many seconds")
    parser.add_argument("--quick", action="store_true", help="50 episodes, 0.05 s latency (smoke test)")
    parser.add_argument("--env", default="builtin/shop", help="The environment (any of GET /envs).")
    parser.add_argument("--split", default="test")
    parser.add_argument("--baseline-env", default=None, help="Run this env first, the same way, and compare.")
    parser.add_argument("--baseline-split", default="test")
    profiles.add_arguments(parser, "the measured run, to FILE (py-spy: --gil --idle --threads)")
    args = parser.parse_args(argv)
    if args.quick:
        args.episodes, args.latency = 50, 0.05

    def run(env: str, split: str) -> dict[str, Any]:
        return run_bench(
            args.episodes,
            args.latency,
            args.env_executor,
            args.env_workers,
            args.max_inflight,
            args.max_wall,
            args.database,
            env,
            split,
            profiles.from_arguments(args),
        )

    if args.baseline_env is None:
        result = run(args.env, args.split)
        print(report(result))
        print(json.dumps(result))
        return result
    baseline = run(args.baseline_env, args.baseline_split)
    print(report(baseline))
    measured = run(args.env, args.split)
    print(report(measured))
    ratio = measured["service_cpu_ms_per_turn"] / max(baseline["service_cpu_ms_per_turn"], 1e-9)
    compared = {
        "env": args.env,
        "baseline_env": args.baseline_env,
        "service_cpu_ms_per_turn": measured["service_cpu_ms_per_turn"],
        "baseline_service_cpu_ms_per_turn": baseline["service_cpu_ms_per_turn"],
        "service_cpu_per_turn_ratio": round(ratio, 3),
        "runs": {"baseline": baseline, "env": measured},
    }
    print(f"service CPU per turn: {args.env} / {args.baseline_env} = {ratio:.3f}")
    print(json.dumps(compared))
    return compared


if __name__ == "__main__":
    main()
