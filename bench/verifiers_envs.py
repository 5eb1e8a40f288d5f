"""verifiers environments through the service: the service's CPU per model call of agent-driven
episodes (each call through the episode's own OpenAI endpoint), against its own loop's CPU per
turn in the same run; and `GET /envs` with the verifiers envs listed, and what listing them adds
to start-up.

`python -m service serve` and `python -m service sim-worker --policy vf_policy:policy` each run in
their own process; the service lists tests/verifiers_tasksets' two tasksets (ENV_PLUGINS). Phase 1
(baseline): N episodes of builtin/shop run by the service's own loop. Phase 2: N episodes of the
two tasksets (single-turn, and multi-turn with bash tools), each handed over to its driver in an
env worker, which calls the episode's endpoint; the service finishes it. Service CPU is the serve
process's own (the API, the worker, the agent endpoints): the env workers are reported apart.

`--agent verifiers`: verifiers' own rollouts. Each is a harness program (a Python process) in
verifiers' subprocess runtime, so a few dozen fit here, their phase lasts minutes, and the service's
CPU at rest outweighs its CPU per call: the figure is noise. `--agent light` (the default, 1,000 in
flight): tests/verifiers_tasksets/vf_wire.py's driver sends the requests verifiers' harnesses send
(streamed chat completions with usage, the same messages and tools) without a harness program; the
service's side (claim, hand-over, calls, finish) is the same. `--profile DIR` records each phase's
service with `--profiler` (py-spy's raw stacks of the GIL holder, or perf's CPU samples). Last,
the light agent's requests go to a bare server (bench/http_floor.py): what an HTTP request alone
costs, against which the driven call's CPU reads.

Run from the repo root in the verifiers virtualenv (`make test-verifiers` builds it):
    PATH=.venv-verifiers/bin:$PATH .venv-verifiers/bin/python bench/verifiers_envs.py [--agent light]
        [--episodes 1000] [--database sqlite|postgres] [--latency 0.05] [--decompose]
        [--profile DIR [--profiler perf]]
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TASKSETS = REPO / "tests" / "verifiers_tasksets"
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(TASKSETS))

import httpx  # noqa: E402

from bench import http_floor, profiles  # noqa: E402
from bench.common import cpu_seconds_of, fresh_database, percentiles_ms, stop, wait_healthy  # noqa: E402
from bench.profiles import Profile, profiled_env, profiling  # noqa: E402
from tests.support.ports import free_port  # noqa: E402

SHOP_TRAIN_TASKS = 200
ENV_WORKERS = 2
# The envs each agent plays: verifiers' own rollouts, or the light agent sending their requests.
AGENTS = {"verifiers": "verifiers/", "light": "wire/"}
GOAL = "verifiers' calls through the episode endpoint <= 1.5x the loop's CPU per turn; GET /envs < 50 ms"


def descendants_cpu(pid: int) -> float:
    """CPU seconds of every live descendant of `pid` (env workers; harness programs that still run)."""
    total = 0.0
    children = Path(f"/proc/{pid}/task/{pid}/children")
    try:
        kids = [int(k) for k in children.read_text().split()]
    except OSError:
        return 0.0
    for kid in kids:
        total += cpu_seconds_of(kid) + descendants_cpu(kid)
    return total


def spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "service", *args], cwd=REPO, env=env, stdout=out, stderr=out,
            start_new_session=True,
        )  # fmt: skip


async def run_batch(
    http: httpx.AsyncClient, bodies: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], float]:
    start = time.perf_counter()
    batches = []
    for body in bodies:
        answer = await http.post("/episodes", json=body)
        answer.raise_for_status()
        batches.append(answer.json()["batch_id"])
    episodes: list[dict[str, Any]] = []
    for batch_id in batches:
        while True:
            batch = (await http.get(f"/batches/{batch_id}", params={"wait": 60})).json()
            if batch["complete"]:
                break
        episodes.extend(batch["episodes"])
    return episodes, time.perf_counter() - start


def phase_profile(profile: Profile | None, phase: str) -> Profile | None:
    """One phase's profile in the --profile DIR: PHASE.txt (py-spy's raw stacks) or PHASE.data (perf's)."""
    if profile is None:
        return None
    return replace(profile, path=profile.path / f"{phase}.{'data' if profile.profiler == 'perf' else 'txt'}")


def loop_bodies(episodes: int) -> list[dict[str, Any]]:
    """About `episodes` of builtin/shop's train split (200 tasks), each task's samples a group."""
    samples = -(-episodes // SHOP_TRAIN_TASKS)
    tasks = list(range(-(-episodes // samples)))
    return [{"env": "builtin/shop", "task_split": "train", "task_indices": tasks, "samples_per_task": samples,
             "max_turns": 10}]  # fmt: skip


def driven_bodies(prefix: str, episodes: int) -> list[dict[str, Any]]:
    """Half single-turn (vf_arithmetic's 20 tasks), half multi-turn with tools (vf_files' 4)."""
    half = episodes // 2
    return [
        {"env": f"{prefix}vf_arithmetic", "task_split": "train",
         "task_indices": list(range(min(20, half or 1))), "samples_per_task": max(1, half // 20),
         "max_turns": 4},
        {"env": f"{prefix}vf_files", "task_split": "train", "task_indices": [0, 1, 2, 3],
         "samples_per_task": max(1, (episodes - half) // 4), "max_turns": 6},
    ]  # fmt: skip


async def fixed_and_per_call(
    http: httpx.AsyncClient, pid: int, idle_rate: float, episodes: int, prefix: str
) -> dict[str, Any]:
    """Each path's service CPU split into a fixed cost per episode and a cost per model call: a line
    through two phases' (CPU per episode, calls per episode) points. The loop: builtin/shop at
    max_turns 10 and 2; the driven path: its two tasksets apart (vf_arithmetic, 1 call; vf_files, 2
    calls whose requests also carry tools and the longer conversation, so its per-call figure is
    an upper bound). The goal's ratio divides by calls a path's whole CPU, episodes' fixed costs in
    it; this says which of the two makes the gap."""

    async def point(bodies: list[dict[str, Any]]) -> tuple[float, float]:
        before = cpu_seconds_of(pid)
        played, seconds = await run_batch(http, bodies)
        cpu = cpu_seconds_of(pid) - before - idle_rate * seconds
        return cpu / len(played) * 1000, sum(e["num_turns"] or 0 for e in played) / len(played)

    short = [{**body, "max_turns": 2} for body in loop_bodies(episodes)]
    single, multi = driven_bodies(prefix, 2 * episodes)
    points = {
        "loop": (await point(loop_bodies(episodes)), await point(short)),
        "driven": (await point([multi]), await point([single])),
    }
    out: dict[str, Any] = {}
    for path, ((ms_a, calls_a), (ms_b, calls_b)) in points.items():
        per_call = (ms_a - ms_b) / (calls_a - calls_b)
        out[path] = {
            "ms_per_episode": [round(ms_a, 3), round(ms_b, 3)],
            "calls_per_episode": [round(calls_a, 3), round(calls_b, 3)],
            "ms_per_call": round(per_call, 3),
            "ms_fixed_per_episode": round(ms_a - per_call * calls_a, 3),
        }
    out["ratio_per_call"] = round(out["driven"]["ms_per_call"] / out["loop"]["ms_per_call"], 3)
    return out


async def measure(
    url: str,
    service_pid: int,
    episodes: int,
    agent: str,
    profile: Profile | None = None,
    decompose: bool = False,
) -> dict[str, Any]:
    prefix = AGENTS[agent]
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        listing = []
        for _ in range(200):
            start = time.perf_counter()
            answer = await http.get("/envs")
            listing.append(time.perf_counter() - start)
            answer.raise_for_status()
        names = [env["name"] for env in answer.json()]

        # Warm both paths (verifiers builds its harness program's environment once).
        await run_batch(http, driven_bodies(prefix, 2))
        await run_batch(http, loop_bodies(1))

        # The service's CPU at rest (heartbeats, sweeps), taken out of both phases' figures.
        before, rest_start = cpu_seconds_of(service_pid), time.perf_counter()
        await asyncio.sleep(10)
        idle_rate = (cpu_seconds_of(service_pid) - before) / (time.perf_counter() - rest_start)

        before = cpu_seconds_of(service_pid)
        with profiling(service_pid, phase_profile(profile, "loop")):
            loop_episodes, loop_seconds = await run_batch(http, loop_bodies(episodes))
        loop_cpu = cpu_seconds_of(service_pid) - before
        loop_turns = sum(e["num_turns"] or 0 for e in loop_episodes)

        before, before_children = cpu_seconds_of(service_pid), descendants_cpu(service_pid)
        with profiling(service_pid, phase_profile(profile, agent)):
            vf_episodes, vf_seconds = await run_batch(http, driven_bodies(prefix, episodes))
        vf_cpu = cpu_seconds_of(service_pid) - before
        vf_children_cpu = descendants_cpu(service_pid) - before_children
        vf_calls = sum(e["num_turns"] or 0 for e in vf_episodes)
        decomposed = (
            await fixed_and_per_call(http, service_pid, idle_rate, episodes, prefix) if decompose else None
        )
    loop_per_turn = (loop_cpu - idle_rate * loop_seconds) / max(loop_turns, 1) * 1000
    vf_per_call = (vf_cpu - idle_rate * vf_seconds) / max(vf_calls, 1) * 1000
    return {
        "envs_listed": len(names),
        "verifiers_envs_listed": sorted(n for n in names if n.startswith("verifiers/")),
        "get_envs": percentiles_ms(listing),
        "service_cpu_at_rest_ms_per_s": round(idle_rate * 1000, 2),
        "loop": {
            "episodes": len(loop_episodes),
            "turns": loop_turns,
            "seconds": round(loop_seconds, 2),
            "statuses": sorted({e["status"] for e in loop_episodes}),
            "service_cpu_ms_per_turn": round(loop_per_turn, 3),  # at rest's share taken out
            "service_cpu_ms_per_turn_raw": round(loop_cpu / max(loop_turns, 1) * 1000, 3),
        },
        "driven": {
            "agent": agent,
            "episodes": len(vf_episodes),
            "model_calls": vf_calls,
            "calls_per_episode": round(vf_calls / max(len(vf_episodes), 1), 2),
            "seconds": round(vf_seconds, 2),
            "statuses": {
                s: sum(1 for e in vf_episodes if e["status"] == s) for s in {e["status"] for e in vf_episodes}
            },
            "rewards": sorted({e["reward"] for e in vf_episodes}, key=str),
            "errors": dict(Counter((e.get("error") or "")[:120] for e in vf_episodes if e.get("error"))),
            "service_cpu_ms_per_call": round(vf_per_call, 3),  # at rest's share taken out
            "service_cpu_ms_per_call_raw": round(vf_cpu / max(vf_calls, 1) * 1000, 3),
            "env_workers_live_cpu_ms_per_call": round(vf_children_cpu / max(vf_calls, 1) * 1000, 3),
        },
        "ratio_call_to_loop_turn": round(vf_per_call / loop_per_turn, 3) if loop_per_turn else None,
        "ratio_raw": round(vf_cpu / max(vf_calls, 1) / (loop_cpu / max(loop_turns, 1)), 3)
        if loop_cpu
        else None,
        "fixed_and_per_call": decomposed,
    }


def startup_cost() -> dict[str, Any]:
    """What listing the verifiers envs adds to start-up: the registry with and without their plugin
    loader, each in a fresh interpreter, and whether verifiers got imported."""
    code = (
        "import sys, time; sys.path[:0] = [{repo!r}, {tasksets!r}]; "
        "from service.envs.registry import available_envs; t = time.perf_counter(); "
        "envs = available_envs({loaders!r}); print(time.perf_counter() - t, len(envs), "
        "'verifiers' in sys.modules)"
    )
    out = {}
    for label, loaders in (("without", []), ("with_verifiers", ["vf_plugins:env_specs"])):
        runs = []
        for _ in range(3):
            line = subprocess.run(
                [sys.executable, "-c", code.format(repo=str(REPO), tasksets=str(TASKSETS), loaders=loaders)],
                capture_output=True, text=True, check=True, cwd=REPO,
            ).stdout.split()  # fmt: skip
            runs.append(float(line[0]))
        out[label] = {
            "ms": round(min(runs) * 1000, 2),
            "envs": int(line[1]),
            "imports_verifiers": line[2] == "True",
        }
    out["added_ms"] = round(out["with_verifiers"]["ms"] - out["without"]["ms"], 2)
    return out


def main() -> None:
    if importlib.util.find_spec("verifiers") is None:  # `make bench` runs every bench in .venv
        print(json.dumps({"goal": GOAL, "skipped": "verifiers is not installed: run it in .venv-verifiers"}))
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--agent", choices=sorted(AGENTS), default="light")
    parser.add_argument(
        "--episodes", type=int, default=None, help="in flight (default: light 1000, verifiers 32)"
    )
    parser.add_argument("--database", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--latency", type=float, default=0.05)
    parser.add_argument(
        "--decompose",
        action="store_true",
        help="four more phases: each path's CPU as a fixed cost per episode and a cost per call",
    )
    profiles.add_arguments(
        parser, "each phase's service, to PHASE.txt (py-spy) or PHASE.data (perf) in the directory FILE"
    )
    args = parser.parse_args()
    profile = profiles.from_arguments(args)
    episodes = args.episodes or (1000 if args.agent == "light" else 32)
    with (
        tempfile.TemporaryDirectory() as tmp_name,
        fresh_database(args.database, Path(tmp_name), migrate=True) as db,
    ):
        tmp = Path(tmp_name)
        env = {
            **os.environ,
            "LOG_LEVEL": "WARNING",
            "PYTHONPATH": os.pathsep.join([str(REPO), str(TASKSETS)]),
        }
        sim_port, port = free_port(), free_port()
        sim_args = ["sim-worker", "--port", str(sim_port), "--latency", str(args.latency)]
        sim = spawn([*sim_args, "--policy", "vf_policy:policy"], env, tmp / "sim.log")
        service = None
        try:
            wait_healthy(f"http://127.0.0.1:{sim_port}", sim, tmp / "sim.log")
            url = f"http://127.0.0.1:{port}"
            service_env = env | {
                "DATABASE_URL": db,
                "SGLANG_URL": f"http://127.0.0.1:{sim_port}",
                "ENV_PLUGINS": "vf_plugins:env_specs,vf_wire:env_specs",
                # Every driven episode of the phase holds an env-call thread while it plays.
                "ENV_THREADS_PER_WORKER": str(episodes // ENV_WORKERS + 8),
                "ENV_WORKERS": str(ENV_WORKERS),
                "SERVICE_URL": url,
                **profiled_env(profile),
            }
            service = spawn(["serve", "--port", str(port)], service_env, tmp / "service.log")
            wait_healthy(url, service, tmp / "service.log")
            result = asyncio.run(measure(url, service.pid, episodes, args.agent, profile, args.decompose))
        finally:
            if service is not None:
                stop(service)
            stop(sim)
    import vf_wire  # the light agent's requests (it imports verifiers)

    # The same requests to a bare server, after the service stopped: an HTTP request's own share.
    floor = http_floor.measure(episodes, system=vf_wire.BASH_SYSTEM, tools=vf_wire.BASH_TOOLS)
    loop_turn = result["loop"]["service_cpu_ms_per_turn"]
    floor["ratio_to_loop_turn"] = (
        round(floor["server_cpu_ms_per_request"] / loop_turn, 3) if loop_turn else None
    )
    result = {"goal": GOAL, "database": args.database, "in_flight": episodes, **result,
              "http_floor": floor, "startup": startup_cost()}  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
