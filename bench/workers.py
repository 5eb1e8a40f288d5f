"""`serve --workers 1` against `serve --workers N`: what a machine's other cores add.

Each run starts `python -m service serve --workers W` as a subprocess on a fresh database (a temp
SQLite file, or a new PostgreSQL database), against one simulated SGLang worker (`python -m service
sim-worker`, its own process, a fixed latency per /generate). It submits one batch of builtin/shop
episodes to the port and long-polls it to completion, as a trainer does. Measured per run: wall time
from submit to the completed batch, episodes/s and turns/s, the CPU of the service's process tree
(parent, service processes, env workers), of the simulated worker, and of the whole machine (the
simulated worker shares its cores, and so may other people's work). Then the ratios N to 1.

Run from the repo root:
    .venv/bin/python bench/workers.py [--episodes 2000] [--latency 0.5] [--workers 2] [--database sqlite]
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import (  # noqa: E402
    SHOP_TEST_TASKS,
    HealthProbe,
    fresh_database,
    serve_process,
    sim_worker,
    submit_and_wait,
)

GOAL_RATIO = 1.7  # issue 10: 2 processes on 2 cores


def process_tree_cpu_seconds(root: int | None) -> float:
    """User + system CPU seconds of `root` and its live descendants (Linux /proc); 0.0 for None."""
    if root is None:
        return 0.0
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(stat.parent.name)
        parents[pid] = int(fields[1])
        cpu[pid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    tree, grew = {root}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    return sum(cpu.get(pid, 0.0) for pid in tree)


def machine_cpu_seconds() -> float:
    """Busy CPU seconds of the whole machine so far, all cores (/proc/stat: not idle nor iowait)."""
    ticks = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


@contextmanager
def engine(args: argparse.Namespace, log_dir: Path) -> Iterator[tuple[str, int | None]]:
    """The engine's URL and the pid of the local simulated worker (None: the engine is elsewhere)."""
    if args.sglang_url:
        yield args.sglang_url, None
        return
    with sim_worker(args.latency, log_dir) as sim:
        yield sim


def run_once(
    workers: int,
    episodes: int,
    sim_url: str,
    sim_pid: int | None,
    kind: str,
    tmp: Path,
    max_wall: float,
    api_processes: int = 0,
) -> dict[str, Any]:
    samples = max(1, episodes // SHOP_TEST_TASKS)
    tasks = min(episodes, SHOP_TEST_TASKS)
    bound = str(max(episodes, 2048))  # the command's totals: no bound below the batch
    with (
        fresh_database(kind, tmp) as database_url,
        serve_process(
            database_url, sim_url, tmp, options=("--workers", str(workers), "--migrate"),
            processes=workers + api_processes, LOG_LEVEL="INFO", ENV_EXECUTOR="thread", ENV_WORKERS="2",
            MAX_RUNNING_EPISODES=bound, MAX_INFLIGHT_GENERATES=bound, SERVE_API_PROCESSES=str(api_processes),
        ) as served,
    ):  # fmt: skip
        load = os.getloadavg()[0]
        cpu0, sim_cpu0 = process_tree_cpu_seconds(served.pid), process_tree_cpu_seconds(sim_pid)
        machine_cpu0 = machine_cpu_seconds()
        started = time.perf_counter()
        health = HealthProbe(served.url)
        health.start()
        batch = submit_and_wait(served.url, tasks, samples, max_wall)
        wall = time.perf_counter() - started
        health_stats = health.stats()
        cpu = process_tree_cpu_seconds(served.pid) - cpu0
        sim_cpu = process_tree_cpu_seconds(sim_pid) - sim_cpu0
        machine_cpu = machine_cpu_seconds() - machine_cpu0
    exit_code = served.process.returncode
    turns = sum(episode["num_turns"] or 0 for episode in batch["episodes"])
    return {
        "workers": workers,
        "api_processes": api_processes,
        "episodes": tasks * samples,
        "finished": batch["finished"],
        "complete": batch["complete"],
        "wall_s": round(wall, 2),
        "episodes_per_s": round(batch["finished"] / wall, 2),
        "turns": turns,
        "turns_per_s": round(turns / wall, 1),
        "service_cpu_s": round(cpu, 1),
        "service_cpu_ms_per_turn": round(1e3 * cpu / max(turns, 1), 2),
        "sim_cpu_s": round(sim_cpu, 1),
        # Cores busy on average, and how many of them ran other people's work (a shared machine).
        "machine_busy_cores": round(machine_cpu / wall, 2),
        "others_busy_cores": round(max(0.0, machine_cpu - cpu - sim_cpu) / wall, 2),
        "statuses": {status: count for status, count in batch["counts"].items() if count},
        "attempts": dict(Counter(str(episode["attempt"]) for episode in batch["episodes"])),
        "load_1m_before": round(load, 2),
        "exit_code": exit_code,
        **health_stats,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--episodes", type=int, default=2000)
    parser.add_argument("--latency", type=float, default=0.5, help="seconds per /generate")
    parser.add_argument("--workers", type=int, default=2, help="compared with 1")
    parser.add_argument("--database", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument(
        "--sglang-url",
        default=None,
        help="an engine elsewhere (a sim worker on another host, SGLang) instead of a local sim worker, "
        "which takes its share of this machine's cores",
    )
    parser.add_argument("--max-wall", type=float, default=600.0, help="stop waiting after this many seconds")
    parser.add_argument(
        "--api-processes", type=int, default=0, help="API-only processes in front, in every run"
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="1 then N, this many times; ratios of the medians"
    )
    parser.add_argument("--quick", action="store_true", help="100 episodes, 0.05 s latency (smoke test)")
    args = parser.parse_args(argv)
    if args.quick:
        args.episodes, args.latency = 100, 0.05
    measured_at = datetime.now(UTC).isoformat(timespec="seconds")
    with (
        tempfile.TemporaryDirectory(prefix="bench-workers-") as tmp,
        engine(args, Path(tmp)) as sim,
    ):
        runs = [
            run_once(
                workers, args.episodes, *sim, args.database, Path(tmp), args.max_wall, args.api_processes
            )
            for _ in range(args.rounds)
            for workers in (1, args.workers)
        ]

    def median_of(workers: int, key: str) -> float:
        return float(statistics.median(run[key] for run in runs if run["workers"] == workers))

    result: dict[str, Any] = {
        "bench": "workers",
        "measured_at": measured_at,
        "database": args.database,
        "engine": args.sglang_url or "local sim worker",
        "latency_s": None if args.sglang_url else args.latency,
        "cpus": os.cpu_count(),
        "runs": runs,
        "goal_ratio": GOAL_RATIO,
    }
    for key in ("turns_per_s", "episodes_per_s"):
        result[f"{key}_ratio"] = round(median_of(args.workers, key) / max(median_of(1, key), 1e-9), 2)
    for run in runs:
        print(
            f"--workers {run['workers']}: {run['finished']}/{run['episodes']} episodes in {run['wall_s']} s: "
            f"{run['episodes_per_s']} episodes/s, {run['turns_per_s']} turns/s; service CPU "
            f"{run['service_cpu_s']} s ({run['service_cpu_ms_per_turn']} ms a turn), sim "
            f"{run['sim_cpu_s']} s; cores busy {run['machine_busy_cores']}, "
            f"{run['others_busy_cores']} other; /health p50 {run['health_p50_ms']} ms, p99 "
            f"{run['health_p99_ms']} ms, errors {run['health_errors']}"
        )
    print(f"ratio {args.workers} to 1: turns/s {result['turns_per_s_ratio']}x, episodes/s "
          f"{result['episodes_per_s_ratio']}x (goal {GOAL_RATIO}x)")  # fmt: skip
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
