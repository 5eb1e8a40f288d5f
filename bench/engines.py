"""Service CPU per turn on the vLLM protocol against the SGLang one, same run (issue 29's goal:
vLLM within 1.1x), at thousands of episodes in flight.

The simulated worker (`python -m service sim-worker`, its own process) answers both protocols
with the same policy and latency. The service runs in this process (create_app with its worker)
and gets one batch of N builtin/shop episodes per run: ENGINE=sglang then ENGINE=vllm, alternated
for --rounds rounds on fresh databases, so that the shared machine's drifting load falls on both.
Service CPU per turn = this process's CPU time over the batch / the generate calls it made (each
turn's records, resumes included: there are none here).

Run from the repo root:
    .venv/bin/python bench/engines.py [--episodes 2000] [--latency 0.5] [--database sqlite|postgres]
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from bench.common import SHOP_TEST_TASKS, fresh_database, run_loop, sim_worker  # noqa: E402
from service.app import create_app  # noqa: E402
from service.config import Settings  # noqa: E402
from service.serving import serve_app  # noqa: E402

ENGINES = ("sglang", "vllm")
GOAL_RATIO = 1.1


async def _batch(
    engine: str, sim_url: str, database_url: str, episodes: int, max_wall: float
) -> dict[str, Any]:
    settings = Settings(
        database_url=database_url,
        engine=engine,
        sglang_url=sim_url,
        api_keys="",
        run_worker=True,
        env_executor="thread",
        max_running_episodes=max(episodes, 2048),
        max_inflight_generates=max(episodes, 2048),
        log_level="WARNING",
        shutdown_timeout_seconds=0,
    )
    async with serve_app(create_app(settings)) as url, httpx.AsyncClient(base_url=url, timeout=600) as client:
        tasks = min(episodes, SHOP_TEST_TASKS)
        body = {
            "env": "builtin/shop",
            "task_split": "test",
            "task_indices": list(range(tasks)),
            "samples_per_task": max(1, episodes // tasks),
            "sampling_params": {"temperature": 1.0, "max_new_tokens": 256},
            "max_turns": 12,
        }
        cpu0, started = time.process_time(), time.perf_counter()
        submitted = await client.post("/episodes", json=body)
        submitted.raise_for_status()
        batch_id = submitted.json()["batch_id"]
        batch: dict[str, Any] = {"complete": False}
        while not batch["complete"] and time.perf_counter() - started < max_wall:
            batch = (await client.get(f"/batches/{batch_id}", params={"wait": 5})).json()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - started
        modes: set[str | None] = set()
        for summary in batch["episodes"][:: max(1, len(batch["episodes"]) // 20)]:  # a sample's turns
            episode = (await client.get(f"/episodes/{summary['id']}")).json()
            modes |= {turn["logprobs_mode"] for turn in episode["turns"]}
        calls = sum(summary["num_turns"] or 0 for summary in batch["episodes"])
    return {
        "engine": engine,
        "complete": batch["complete"],
        "episodes": len(batch["episodes"]),
        "statuses": {status: count for status, count in batch["counts"].items() if count},
        "generate_calls": calls,
        "wall_s": round(wall, 2),
        "turns_per_s": round(calls / wall, 1),
        "service_cpu_s": round(cpu, 2),
        "service_cpu_ms_per_turn": round(1e3 * cpu / max(calls, 1), 3),
        "logprobs_modes": sorted(str(mode) for mode in modes),
    }


def run_bench(episodes: int, latency: float, database: str, rounds: int, max_wall: float) -> dict[str, Any]:
    logging.getLogger().setLevel(logging.WARNING)
    runs: list[dict[str, Any]] = []
    thresholds = gc.get_threshold()
    with (
        tempfile.TemporaryDirectory(prefix="bench-engines-") as tmp,
        sim_worker(latency, Path(tmp)) as (url, _),
    ):
        for round_index in range(rounds):
            order = ENGINES if round_index % 2 == 0 else ENGINES[::-1]
            for engine in order:
                with fresh_database(database, Path(tmp), migrate=True) as database_url:
                    try:
                        result = run_loop(_batch(engine, url, database_url, episodes, max_wall))
                    finally:
                        gc.unfreeze()  # the service froze the heap (Settings.tune_gc); the bench goes on
                        gc.set_threshold(*thresholds)
                result["round"] = round_index
                print(json.dumps(result), file=sys.stderr)
                runs.append(result)
    per_turn = {
        engine: statistics.median(run["service_cpu_ms_per_turn"] for run in runs if run["engine"] == engine)
        for engine in ENGINES
    }
    ratio = per_turn["vllm"] / per_turn["sglang"]
    return {
        "bench": "engines",
        "episodes": episodes,
        "latency_s": latency,
        "database": database,
        "rounds": rounds,
        "service_cpu_ms_per_turn_vllm": per_turn["vllm"],
        "service_cpu_ms_per_turn_sglang": per_turn["sglang"],  # the same run's baseline
        "vllm_over_sglang": round(ratio, 3),
        "goal": GOAL_RATIO,
        "met": ratio <= GOAL_RATIO,
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--episodes", type=int, default=2000)
    parser.add_argument("--latency", type=float, default=0.5)
    parser.add_argument("--database", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--rounds", type=int, default=2, help="each engine runs once per round, alternating")
    parser.add_argument("--max-wall", type=float, default=300.0)
    parser.add_argument(
        "--quick", action="store_true", help="50 episodes, 0.05 s latency, 1 round (smoke test)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.episodes, args.latency, args.rounds = 50, 0.05, 1
    result = run_bench(args.episodes, args.latency, args.database, args.rounds, args.max_wall)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
