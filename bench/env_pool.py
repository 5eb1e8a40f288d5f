"""Episodes per second of CPU-heavy env work through EnvHost: worker processes vs threads.

Each episode: open, reset, a few cheap tool steps, then a final step that burns BURN_CPU_SECONDS
of pure-Python CPU (like tau-bench's reward computation, 0.3-0.75 s holding the GIL), close.
Then IN_FLIGHT episodes each take one USER_TURN_SECONDS step that blocks on I/O, like a user-simulator
turn (an HTTP call inside env.step): they should overlap, taking about USER_TURN_SECONDS in all.
Run from the repo root: .venv/bin/python bench/env_pool.py [--episodes N] [--workers W]
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from service.envs.base import RESPOND_ACTION_NAME, Action, EnvSpec, Reset, Step, UserSimConfig
from service.envs.host import EnvHost

BURN_CPU_SECONDS = 0.3  # CPU time of the final step, measured per thread
TOOL_STEPS = 3
IN_FLIGHT = 8  # concurrent episodes, as the episode runner would have
LAG_PROBE_SECONDS = 0.01
USER_TURN_SECONDS = 0.5  # a blocking user-simulator turn inside env.step
USER_TURN = "user_turn"


def burn(cpu_seconds: float) -> int:
    # Thread CPU time, so each episode does the same work however the GIL is shared.
    start = time.thread_time()
    total = 0
    while time.thread_time() - start < cpu_seconds:
        for i in range(2000):
            total += i * i % 7
    return total


class BurnEnv:
    system_prompt = "bench"
    tools: list[dict[str, object]] = []

    def __init__(self, split: str, user_sim: UserSimConfig) -> None:
        self.steps = 0

    def reset(self, task_index: int) -> Reset:
        return Reset(observation=f"task {task_index}")

    def step(self, action: Action) -> Step:
        self.steps += 1
        if action.name == USER_TURN:
            time.sleep(USER_TURN_SECONDS)
        if action.name == RESPOND_ACTION_NAME:
            return Step(observation="bye", reward=float(burn(BURN_CPU_SECONDS) >= 0), done=True)
        return Step(observation=f"result {self.steps}", reward=0.0, done=False)


def burn_env(split: str, user_sim: UserSimConfig) -> BurnEnv:
    return BurnEnv(split, user_sim)


ENVS = {"bench/burn": EnvSpec("bench/burn", {"train": 1000}, "CPU-heavy final step.", burn_env)}


async def episode(host: EnvHost, index: int) -> float:
    session = await host.open("bench/burn", "train", f"ep-{index}")
    try:
        await session.reset(index)
        for _ in range(TOOL_STEPS):
            await session.step(Action("lookup", {}))
        final = await session.step(Action(RESPOND_ACTION_NAME, {"content": "done"}))
        return final.reward
    finally:
        await session.close()


async def measure_lag(stop: asyncio.Event, lags: list[float]) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        await asyncio.sleep(LAG_PROBE_SECONDS)
        lags.append(time.perf_counter() - start - LAG_PROBE_SECONDS)


async def run(executor: str, workers: int, episodes: int) -> dict[str, float]:
    host = EnvHost(workers=workers, executor=executor, envs=ENVS)
    try:
        await host.worker_pids()  # start the workers outside the timing
        gate = asyncio.Semaphore(IN_FLIGHT)

        async def gated(index: int) -> float:
            async with gate:
                return await episode(host, index)

        stop, lags = asyncio.Event(), []
        probe = asyncio.create_task(measure_lag(stop, lags))
        start = time.perf_counter()
        rewards = await asyncio.gather(*(gated(i) for i in range(episodes)))
        elapsed = time.perf_counter() - start
        stop.set()
        await probe
        assert rewards == [1.0] * episodes
        user_turns_seconds = await concurrent_user_turns(host)
    finally:
        await host.close()
    return {
        "seconds": elapsed,
        "eps_per_s": episodes / elapsed,
        "max_loop_lag_ms": 1000 * max(lags, default=0),
        "user_turns_seconds": user_turns_seconds,
    }


async def concurrent_user_turns(host: EnvHost) -> float:
    """Seconds for IN_FLIGHT episodes to each play one blocking user turn, all at once."""
    sessions = [await host.open("bench/burn", "train", f"user-{i}") for i in range(IN_FLIGHT)]
    try:
        start = time.perf_counter()
        await asyncio.gather(*(session.step(Action(USER_TURN, {})) for session in sessions))
        return time.perf_counter() - start
    finally:
        for session in sessions:
            await session.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=24)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    results = {}
    for executor in ("process", "thread"):
        results[executor] = result = await run(executor, args.workers, args.episodes)
        print(
            f"{executor:>7}: {args.episodes} episodes in {result['seconds']:.2f} s = "
            f"{result['eps_per_s']:.2f} episodes/s; max event-loop lag {result['max_loop_lag_ms']:.0f} ms; "
            f"{IN_FLIGHT} concurrent {USER_TURN_SECONDS} s user turns in {result['user_turns_seconds']:.2f} s"
        )
    ideal = args.workers / BURN_CPU_SECONDS
    print(f"ideal with {args.workers} cores: {ideal:.2f} episodes/s ({BURN_CPU_SECONDS} s CPU each)")
    summary = {
        "process_eps_per_s": round(results["process"]["eps_per_s"], 3),
        "thread_eps_per_s": round(results["thread"]["eps_per_s"], 3),
        "ratio": round(results["process"]["eps_per_s"] / results["thread"]["eps_per_s"], 3),
        "process_max_loop_lag_ms": round(results["process"]["max_loop_lag_ms"], 1),
        "thread_max_loop_lag_ms": round(results["thread"]["max_loop_lag_ms"], 1),
        "process_user_turns_s": round(results["process"]["user_turns_seconds"], 3),
        "thread_user_turns_s": round(results["thread"]["user_turns_seconds"], 3),
        "user_turns": IN_FLIGHT,
        "user_turn_seconds": USER_TURN_SECONDS,
        "workers": args.workers,
        "episodes": args.episodes,
        "burn_cpu_seconds": BURN_CPU_SECONDS,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    asyncio.run(main())
