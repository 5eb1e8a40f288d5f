"""Many trainers polling one big batch while it runs: the reads must not queue behind the writes.

`python -m service serve` runs as its own process on a fresh database with a batch of N builtin/shop
episodes in flight against the simulated SGLang worker (its own process). Clients in this process
then poll GET /batches/{id} (the JSON summary), each every --interval seconds: first one client
alone (the baseline), then --clients at once for --seconds, while a probe asks /health. Measured:
status codes (every 5xx counted), the GET latency percentiles of both phases and their ratio, /health
latency, how many episodes finished meanwhile, and what the service logged of pool timeouts,
locked databases and lost leases.

Run from the repo root:
    .venv/bin/python bench/polling.py [--episodes 10000] [--clients 200] [--database postgres]
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import (  # noqa: E402
    fresh_database,
    percentiles_ms,
    run_loop,
    serve_process,
    sim_worker,
)

SHOP_TRAIN_TASKS = 200
HEALTH_INTERVAL_SECONDS = 0.2
BASELINE_SECONDS = 10.0  # at most: no longer than the loaded phase (--seconds)
GOAL_P99_MS = 1000.0  # issue 11: GET /batches/{id} p99 under 1 s with 200 clients, 0 5xx
LOG_SIGNS = {  # what the service must never log under this load
    "pool_timeouts": "QueuePool limit",
    "database_locked": "database is locked",
    "lost_leases": "lost the lease",
    "failed_writes": "writing episode",
}


class Poller:
    """Clients that each GET the batch every `interval` seconds, recording latency and status."""

    def __init__(self, session: aiohttp.ClientSession, url: str, interval: float) -> None:
        self.session, self.url, self.interval = session, url, interval
        self.latencies: list[float] = []
        self.statuses: Counter[str] = Counter()
        self.last = b""  # the last body: parsed once, at the end (parsing each would load the client)

    async def client(self, until: float, offset: float) -> None:
        await asyncio.sleep(offset)  # spread the clients over an interval, as independent trainers are
        while time.monotonic() < until:
            started = time.perf_counter()
            try:
                async with self.session.get(self.url) as response:
                    body = await response.read()
                    self.statuses[str(response.status)] += 1
                    if response.status == 200:
                        self.last = body
            except aiohttp.ClientError as error:
                self.statuses[type(error).__name__] += 1
            self.latencies.append(time.perf_counter() - started)
            await asyncio.sleep(max(0.0, self.interval - (time.perf_counter() - started)))

    async def run(self, clients: int, seconds: float) -> dict[str, Any]:
        until = time.monotonic() + seconds
        await asyncio.gather(
            *(self.client(until, self.interval * index / clients) for index in range(clients))
        )
        return {
            "requests": len(self.latencies),
            "statuses": dict(self.statuses),
            "server_errors": sum(n for status, n in self.statuses.items() if status.startswith("5")),
            **{f"get_{key}": value for key, value in percentiles_ms(self.latencies).items()},
        }


async def health_probe(session: aiohttp.ClientSession, url: str, stop_at: asyncio.Event) -> dict[str, Any]:
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    while not stop_at.is_set():
        started = time.perf_counter()
        try:
            async with session.get(f"{url}/health") as response:
                await response.read()
                if response.status != 200:
                    errors[str(response.status)] += 1
        except aiohttp.ClientError as error:
            errors[type(error).__name__] += 1
        latencies.append(time.perf_counter() - started)
        await asyncio.sleep(HEALTH_INTERVAL_SECONDS)
    return {**{f"health_{k}": v for k, v in percentiles_ms(latencies).items()}, "health_errors": dict(errors)}


async def measure(url: str, episodes: int, clients: int, seconds: float, interval: float) -> dict[str, Any]:
    samples = max(1, episodes // SHOP_TRAIN_TASKS)
    tasks = min(episodes, SHOP_TRAIN_TASKS)
    connector = aiohttp.TCPConnector(limit=clients + 8)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        started = time.perf_counter()
        async with session.post(
            f"{url}/episodes",
            json={
                "env": "builtin/shop",
                "task_split": "train",
                "task_indices": list(range(tasks)),
                "samples_per_task": samples,
                "sampling_params": {"temperature": 1.0, "max_new_tokens": 256},
                "max_turns": 12,
            },
        ) as response:
            assert response.status == 202, await response.text()
            batch_id = (await response.json())["batch_id"]
        submit_s = time.perf_counter() - started
        batch_url = f"{url}/batches/{batch_id}"
        stop_health = asyncio.Event()
        health = asyncio.create_task(health_probe(session, url, stop_health))
        baseline = await Poller(session, batch_url, interval).run(1, min(BASELINE_SECONDS, seconds))
        loaded = Poller(session, batch_url, interval)
        result = await loaded.run(clients, seconds)
        stop_health.set()
        health_result = await health
    last = json.loads(loaded.last) if loaded.last else {}
    return {
        "episodes": tasks * samples,
        "submit_s": round(submit_s, 2),
        "clients": clients,
        "interval_s": interval,
        "seconds": seconds,
        "baseline_get_p50_ms": baseline["get_p50_ms"],
        "baseline_get_p99_ms": baseline["get_p99_ms"],
        **result,
        "get_p99_ratio_to_baseline": round(result["get_p99_ms"] / max(baseline["get_p99_ms"], 0.01), 1),
        **health_result,
        "server_errors": result["server_errors"] + baseline["server_errors"],
        "finished_at_end": last.get("finished"),
        "running_at_end": (last.get("counts") or {}).get("running"),
        "episodes_listed_at_end": len(last.get("episodes") or []),
    }


def run_bench(
    episodes: int = 10_000,
    clients: int = 200,
    seconds: float = 60.0,
    interval: float = 1.0,
    latency: float = 1.0,
    database: str = "postgres",
    serve_workers: int = 1,
    api_processes: int = 0,
) -> dict[str, Any]:
    with (
        tempfile.TemporaryDirectory(prefix="bench-polling-") as tmp_name,
        fresh_database(database, Path(tmp_name), migrate=True) as database_url,
        sim_worker(latency, Path(tmp_name)) as (sim_url, _),
    ):
        with serve_process(
            database_url, sim_url, Path(tmp_name), LOG_LEVEL="INFO",
            MAX_RUNNING_EPISODES=str(episodes), MAX_INFLIGHT_GENERATES=str(episodes),
            SERVE_WORKERS=str(serve_workers), SERVE_API_PROCESSES=str(api_processes),
        ) as served:  # fmt: skip
            result = run_loop(measure(served.url, episodes, clients, seconds, interval))
        text = served.log.read_text(errors="replace")
    result.update({name: text.count(sign) for name, sign in LOG_SIGNS.items()})
    result.update(
        {
            "database": database,
            "serve_workers": serve_workers,
            "api_processes": api_processes,
            "latency_s": latency,
            "cpus": os.cpu_count(),
            "goal_met": result["server_errors"] == 0 and result["get_p99_ms"] < GOAL_P99_MS,
        }
    )
    return result


def report(r: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"{r['episodes']} builtin/shop episodes in flight ({r['database']}, {r['serve_workers']} service "
            f"process(es) + {r['api_processes']} API-only, engine latency {r['latency_s']} s); "
            f"{r['clients']} clients polling every "
            f"{r['interval_s']} s for {r['seconds']:.0f} s",
            f"GET /batches/{{id}}: {r['requests']} requests, statuses {r['statuses']}; p50 "
            f"{r['get_p50_ms']:.1f} ms, p99 {r['get_p99_ms']:.1f} ms, max {r['get_max_ms']:.1f} ms "
            f"(one client alone: p50 {r['baseline_get_p50_ms']:.1f} ms, p99 {r['baseline_get_p99_ms']:.1f} "
            f"ms; p99 ratio {r['get_p99_ratio_to_baseline']}x)",
            f"/health: p50 {r['health_p50_ms']:.1f} ms, p99 {r['health_p99_ms']:.1f} ms, errors "
            f"{r['health_errors']}",
            f"at the end: {r['finished_at_end']} finished, {r['running_at_end']} running, "
            f"{r['episodes_listed_at_end']} listed",
            f"service log: pool timeouts {r['pool_timeouts']}, database locked {r['database_locked']}, "
            f"lost leases {r['lost_leases']}, failed writes {r['failed_writes']}; goal met: {r['goal_met']}",
        ]
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--episodes", type=int, default=10_000)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between one client's polls")
    parser.add_argument("--latency", type=float, default=1.0, help="the simulated engine's seconds per call")
    parser.add_argument("--database", choices=["sqlite", "postgres"], default="postgres")
    parser.add_argument("--workers", type=int, default=1, help="service processes (serve --workers)")
    parser.add_argument(
        "--api-processes", type=int, default=0, help="API-only processes in front (serve --api-processes)"
    )
    parser.add_argument("--quick", action="store_true", help="200 episodes, 10 clients, 5 s (smoke test)")
    args = parser.parse_args(argv)
    if args.quick:
        args.episodes, args.clients, args.seconds = 200, 10, 5.0
    result = run_bench(
        args.episodes,
        args.clients,
        args.seconds,
        args.interval,
        args.latency,
        args.database,
        args.workers,
        args.api_processes,
    )
    print(report(result))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
