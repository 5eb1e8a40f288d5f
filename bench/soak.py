"""A soak: thousands of episodes in flight for an hour or more, as a shared training run keeps them.

`python -m service serve` runs as a subprocess on a fresh database (PostgreSQL by default) against a
simulated SGLang worker in its own process. A driver keeps `--in-flight` episodes running: it
submits a batch (8 tasks x 8 samples of builtin/shop) whenever enough have finished, long-polls
each batch as a trainer does, cancels a running batch every `--cancel-every` seconds, pauses
generation (mode abort), updates the worker's weights and continues every `--update-every`
seconds, and polls as a viewer does (`GET /batches`, a batch's episodes, /metrics) every few
seconds. Every minute it samples the service's process tree: resident memory, open file
descriptors, database connections (PostgreSQL's pg_stat_activity), /health latency (the event
loop's lag as a probe sees it), episodes finished, and request errors.

At the end it stops submitting, lets the rest finish, and checks that nothing was lost or done
twice: every accepted episode has a final status, and the stream of complete groups (`GET /groups`)
names each group once. Reported: the series, and over the last half of the run the growth of each
resource (a least-squares line's rise over that half, as a share of its start) and the throughput
against the first ten minutes'. Goals (issue 35): memory and descriptors grow < 5% over the last
half hour, 0 errors, 0 lost or duplicated, throughput within 10% of the first ten minutes.

Run from the repo root (the last line of output is one JSON object):
    .venv/bin/python bench/soak.py [--minutes 60] [--in-flight 2000] [--database postgres]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from pathlib import Path
from typing import Any

import asyncpg
import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import (  # noqa: E402
    POSTGRES_HOST,
    SHOP_TEST_TASKS,
    HealthProbe,
    fresh_database,
    percentiles_ms,
    serve_process,
    sim_worker,
)
from bench.workers import process_tree_cpu_seconds  # noqa: E402

TASKS, SAMPLES = 8, 8
BATCH = TASKS * SAMPLES  # 64 episodes
VIEWER_POLL_SECONDS = 5.0
BATCH_POLL_SECONDS = 30.0  # each trainer's long-poll of its batch
FIRST_MINUTES = 10  # the throughput baseline
DRAIN_TIMEOUT_SECONDS = 600.0
TOP_SITES, TOP_FRAMES = 15, 4  # tracemalloc's growing sites reported, and frames of each
GOALS = {"rss_growth": 0.05, "fds_growth": 0.05, "throughput_ratio_min": 0.9}


def tree_pids(root: int) -> list[int]:
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    pids, frontier = [root], [root]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier]
        pids += children
        frontier = children
    return pids


def rss_and_fds(root: int) -> tuple[float, int]:
    """Resident MiB and open descriptors of `root` and its descendants."""
    rss_kib, fds = 0, 0
    for pid in tree_pids(root):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            rss_kib += next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
            fds += len(os.listdir(f"/proc/{pid}/fd"))
        except (OSError, StopIteration):
            continue
    return rss_kib / 1024, fds


async def database_connections(database_url: str) -> int | None:
    if not database_url.startswith("postgresql"):
        return None
    name = database_url.rsplit("/", 1)[1]
    connection = await asyncpg.connect(f"postgresql://{POSTGRES_HOST}/postgres")
    try:
        return int(
            await connection.fetchval("SELECT count(*) FROM pg_stat_activity WHERE datname = $1", name)
        )
    finally:
        await connection.close()


def tracemalloc_growth(directory: Path, minutes: list[int], rss: dict[int, float]) -> dict[str, Any]:
    """What the service's snapshots (TRACEMALLOC_DIR, one per `minutes`) show: the Python heap traced at
    each beside the process tree's RSS, and the sites that grew most from the snapshot at the half of
    the run to the last (by line, and by the innermost frames)."""
    paths = sorted(directory.glob("tracemalloc-*.pickle"))
    if len(paths) < 2:
        return {"error": f"{len(paths)} snapshots in {directory}"}
    traced = []
    for minute, path in zip(minutes, paths, strict=False):
        snapshot = tracemalloc.Snapshot.load(str(path))
        traced.append({"minute": minute, "traced_mib": round(sum(t.size for t in snapshot.traces) / 2**20, 1),
                       "rss_mib": rss[minute]})  # fmt: skip
    untraced = [tracemalloc.Filter(False, tracemalloc.__file__)]  # the snapshot's own work
    first = tracemalloc.Snapshot.load(str(paths[(len(paths) - 1) // 2])).filter_traces(untraced)
    last = tracemalloc.Snapshot.load(str(paths[-1])).filter_traces(untraced)

    def top(key: str) -> list[dict[str, Any]]:
        grown = sorted(last.compare_to(first, key), key=lambda d: d.size_diff, reverse=True)[:TOP_SITES]
        return [{"site": [str(frame) for frame in reversed(stat.traceback)][:TOP_FRAMES],  # innermost first
                 "grew_kib": round(stat.size_diff / 1024, 1), "count_diff": stat.count_diff,
                 "kib": round(stat.size / 1024, 1)} for stat in grown]  # fmt: skip

    return {"from_minute": minutes[(len(paths) - 1) // 2], "to_minute": minutes[len(paths) - 1],
            "traced": traced, "by_line": top("lineno"), "by_traceback": top("traceback")}  # fmt: skip


def gc_pauses(metrics_text: str) -> dict[str, dict[str, float]] | None:
    """The service's garbage collections by generation (rollout_gc_pause_seconds): how many, their
    total and mean, and the smallest bucket bound that holds the longest. None before the metric."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, dict[str, Any]] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name != "rollout_gc_pause_seconds":
            continue
        for sample in family.samples:
            entry = found.setdefault(sample.labels["generation"], {"buckets": []})
            if sample.name.endswith("_count"):
                entry["count"] = sample.value
            elif sample.name.endswith("_sum"):
                entry["sum_s"] = sample.value
            elif sample.name.endswith("_bucket"):
                entry["buckets"].append((float(sample.labels["le"]), sample.value))
    if not found:
        return None
    report = {}
    for generation, entry in sorted(found.items()):
        count, total = entry["count"], entry["sum_s"]
        longest = min((bound for bound, below in entry["buckets"] if below >= count), default=None)
        report[generation] = {"count": int(count), "sum_s": round(total, 2),
                              "mean_ms": round(1000 * total / count, 2) if count else 0.0,
                              "longest_under_s": longest}  # fmt: skip
    return report


def growth(values: list[float]) -> float | None:
    """The least-squares line's rise over the series, as a share of its start (None: too short)."""
    n = len(values)
    if n < 3:
        return None
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    slope = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(values)) / sum(
        (x - mean_x) ** 2 for x in range(n)
    )
    start = mean_y - slope * mean_x
    return round(slope * (n - 1) / start, 4) if start else None


class Driver:
    def __init__(self, url: str, sim_url: str, in_flight: int) -> None:
        self.url, self.sim_url, self.in_flight = url, sim_url, in_flight
        self.http = httpx.AsyncClient(base_url=url, timeout=BATCH_POLL_SECONDS + 60)
        self.errors: Counter[str] = Counter()
        self.accepted: dict[str, int] = {}  # batch id -> episodes
        self.open: set[str] = set()
        self.finished = 0  # episodes of batches seen complete
        self.cancelled_batches = 0
        self.updates = 0
        self.submitting = True
        self.reserved = 0  # episodes of batches being submitted
        self.room = asyncio.Condition()

    def _bad(self, what: str, response: httpx.Response | None, error: Exception | None = None) -> None:
        self.errors[f"{what}: {response.status_code if response is not None else type(error).__name__}"] += 1

    async def _call(self, what: str, method: str, path: str, **kwargs: Any) -> httpx.Response | None:
        try:
            response = await self.http.request(method, path, **kwargs)
        except httpx.HTTPError as error:
            self._bad(what, None, error)
            return None
        if response.status_code >= 400:
            self._bad(what, response)
        return response

    def episodes_open(self) -> int:
        return sum(self.accepted[batch] for batch in self.open)

    def has_room(self) -> bool:
        return self.episodes_open() + self.reserved + BATCH <= self.in_flight

    async def submitter(self) -> None:
        """Keeps `in_flight` episodes accepted: a batch's room is reserved before its POST, and the
        POSTs run side by side (one at a time, each waiting seconds behind the service's writer at
        2,000 in flight, kept only about 700 in flight)."""
        index = 0
        while self.submitting:
            async with self.room:
                await self.room.wait_for(lambda: not self.submitting or self.has_room())
                if not self.submitting:
                    return
                self.reserved += BATCH
            asyncio.get_running_loop().create_task(self.submit(f"soak-{index}", index))
            index += 1

    async def submit(self, batch_id: str, index: int) -> None:
        tasks = [(index * TASKS + t) % SHOP_TEST_TASKS for t in range(TASKS)]
        body = {"batch_id": batch_id, "env": "builtin/shop", "task_split": "test", "task_indices": tasks,
                "samples_per_task": SAMPLES, "max_turns": 8,
                "sampling_params": {"temperature": 0.7, "max_new_tokens": 64}}  # fmt: skip
        response = await self._call("submit", "POST", "/episodes", json=body)
        if response is None or response.status_code != 202:
            await asyncio.sleep(1)
        async with self.room:
            self.reserved -= BATCH
            if response is not None and response.status_code == 202:
                self.accepted[batch_id] = len(response.json()["episode_ids"])
                self.open.add(batch_id)
                asyncio.get_running_loop().create_task(self.trainer(batch_id))
            self.room.notify_all()

    async def trainer(self, batch_id: str) -> None:
        while True:
            response = await self._call(
                "poll", "GET", f"/batches/{batch_id}", params={"wait": BATCH_POLL_SECONDS}
            )
            if response is not None and response.status_code == 200 and response.json()["complete"]:
                break
            if response is None or response.status_code != 200:
                await asyncio.sleep(1)
        async with self.room:
            self.open.discard(batch_id)
            self.finished += self.accepted[batch_id]
            self.room.notify_all()

    async def canceller(self, every: float) -> None:
        while self.submitting:
            await asyncio.sleep(every)
            if self.open:
                batch_id = random.choice(sorted(self.open))
                if await self._call("cancel", "POST", f"/batches/{batch_id}/cancel") is not None:
                    self.cancelled_batches += 1

    async def updater(self, every: float) -> None:
        while self.submitting:
            await asyncio.sleep(every)
            self.updates += 1
            try:
                await self._call("pause", "POST", "/engine/pause", json={"mode": "abort"})
                async with httpx.AsyncClient(base_url=self.sim_url, timeout=30) as sim:
                    await sim.post(
                        "/update_weights_from_disk",
                        json={"model_path": "soak", "weight_version": str(self.updates)},
                    )
            except httpx.HTTPError as error:
                self._bad("update", None, error)
            finally:  # cancelled mid-update (the run's end), the engine must not stay paused
                await self._call("continue", "POST", "/engine/continue")

    async def viewer(self) -> None:
        while self.submitting:
            await self._call("viewer", "GET", "/batches", params={"limit": 50})
            if self.open:
                await self._call("viewer", "GET", f"/batches/{sorted(self.open)[-1]}/episodes")
            await self._call("metrics", "GET", "/metrics")
            await asyncio.sleep(VIEWER_POLL_SECONDS)

    async def groups_once(self) -> tuple[int, int]:
        """Groups in the stream, and how many came more than once."""
        seen: Counter[tuple[str, int]] = Counter()
        cursor = 0
        while True:
            response = await self._call("groups", "GET", "/groups", params={"after": cursor, "limit": 1000})
            if response is None or response.status_code != 200:
                raise RuntimeError("GET /groups failed at the end")
            page = response.json()
            seen.update((group["batch_id"], group["group_index"]) for group in page["groups"])
            if not page["groups"]:
                return len(seen), sum(1 for count in seen.values() if count > 1)
            cursor = page["next"]


async def soak(
    url: str, sim_url: str, serve_pid: int, database_url: str, args: argparse.Namespace
) -> dict[str, Any]:
    driver = Driver(url, sim_url, args.in_flight)
    if args.tracemalloc:
        os.kill(serve_pid, signal.SIGUSR2)  # starts tracing: start-up's imports ran untraced
    health = HealthProbe(url)
    health.start()
    loops = (driver.submitter(), driver.canceller(args.cancel_every), driver.updater(args.update_every),
             driver.viewer())  # fmt: skip
    tasks = [asyncio.create_task(loop) for loop in loops]
    samples: list[dict[str, Any]] = []
    snapshot_minutes: list[int] = []
    started = time.monotonic()
    cpu0, finished0, probes0 = process_tree_cpu_seconds(serve_pid), 0, 0
    for minute in range(1, args.minutes + 1):
        await asyncio.sleep(max(0.0, started + args.sample_seconds * minute - time.monotonic()))
        rss, fds = rss_and_fds(serve_pid)
        cpu = process_tree_cpu_seconds(serve_pid)
        probes = len(health.latencies)
        sample = {"minute": minute, "rss_mib": round(rss, 1), "fds": fds,
                  "db_connections": await database_connections(database_url),
                  "health": percentiles_ms(health.latencies[probes0:probes]),
                  "episodes_finished": driver.finished - finished0, "cpu_seconds": round(cpu - cpu0, 1),
                  "running_batches": len(driver.open), "episodes_open": driver.episodes_open(),
                  "errors": sum(driver.errors.values()), "load1": round(os.getloadavg()[0], 2)}  # fmt: skip
        samples.append(sample)
        print(json.dumps(sample), flush=True)
        if args.tracemalloc and minute % args.snapshot_every == 0:
            os.kill(serve_pid, signal.SIGUSR2)  # after the sample: the snapshot stops its loop a while
            snapshot_minutes.append(minute)
        cpu0, finished0, probes0 = cpu, driver.finished, probes
    driver.submitting = False
    async with driver.room:
        driver.room.notify_all()
    for task in tasks:
        task.cancel()
    async with driver.room:  # the batches still open, or still being submitted, finish (or are lost)
        try:
            await asyncio.wait_for(
                driver.room.wait_for(lambda: not driver.open and not driver.reserved), DRAIN_TIMEOUT_SECONDS
            )
        except TimeoutError:
            pass
    groups, duplicated = await driver.groups_once()
    health_stats = health.stats()
    lost = sum(driver.accepted[batch] for batch in driver.open)  # batches that never completed
    half = samples[len(samples) // 2 :]
    first = [s["episodes_finished"] for s in samples[:FIRST_MINUTES]]
    last = [s["episodes_finished"] for s in half]
    ratio = (sum(last) / len(last)) / (sum(first) / len(first)) if first and last and sum(first) else None
    scraped = await driver._call("metrics", "GET", "/metrics")
    collections = gc_pauses(scraped.text) if scraped is not None and scraped.status_code == 200 else None
    await driver.http.aclose()
    return {
        "minutes": args.minutes, "in_flight": args.in_flight, "database": args.database,
        "episodes_accepted": sum(driver.accepted.values()), "batches": len(driver.accepted),
        "batches_cancelled": driver.cancelled_batches, "weight_updates": driver.updates,
        "groups_streamed": groups, "groups_duplicated": duplicated, "episodes_lost": lost,
        "errors": dict(driver.errors), **health_stats, "gc_pauses": collections,
        "last_half": {
            "rss_growth": growth([s["rss_mib"] for s in half]),
            "fds_growth": growth([float(s["fds"]) for s in half]),
            "db_connections_growth": growth([float(s["db_connections"] or 0) for s in half]),
            "health_p99_growth": growth([s["health"]["p99_ms"] for s in half]),
            "throughput_vs_first_minutes": round(ratio, 3) if ratio is not None else None,
        },
        "goals": GOALS,
        "snapshot_minutes": snapshot_minutes,
        "samples": samples,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=int, default=60)
    parser.add_argument("--in-flight", type=int, default=2000)
    parser.add_argument("--database", choices=["postgres", "sqlite"], default="postgres")
    parser.add_argument("--latency", type=float, default=0.5, help="the simulated worker's seconds per call")
    parser.add_argument("--update-every", type=float, default=180.0)
    parser.add_argument("--cancel-every", type=float, default=60.0)
    parser.add_argument("--sample-seconds", type=float, default=60.0, help="a 'minute' (a smoke run)")
    parser.add_argument(
        "--serve-env", action="append", default=[], metavar="NAME=VALUE",
        help="an environment variable for `serve` alone (repeatable), e.g. MALLOC_ARENA_MAX=2",
    )  # fmt: skip
    parser.add_argument(
        "--tracemalloc", type=Path, default=None, metavar="DIR",
        help="serve traces its Python allocations (TRACEMALLOC_DIR=DIR) and writes a snapshot there every "
        "--snapshot-every minutes; the growth between the half and the end is reported",
    )  # fmt: skip
    parser.add_argument("--snapshot-every", type=int, default=5, metavar="MINUTES")
    args = parser.parse_args(argv)
    serve_env = dict(item.split("=", 1) for item in args.serve_env)
    if args.tracemalloc:
        serve_env["TRACEMALLOC_DIR"] = str(args.tracemalloc)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        with (
            sim_worker(args.latency, tmp) as (sim_url, _),
            fresh_database(args.database, tmp) as database_url,
        ):
            bound = str(max(args.in_flight, 2048))
            with serve_process(
                database_url, sim_url, tmp, options=("--migrate",), ENV_EXECUTOR="thread",
                MAX_RUNNING_EPISODES=bound, MAX_INFLIGHT_GENERATES=bound, **serve_env,
            ) as served:  # fmt: skip
                result = asyncio.run(soak(served.url, sim_url, served.pid, database_url, args))
            result |= {"serve_env": serve_env, "serve_exit_code": served.process.returncode}
            result |= {"error_log_lines": served.error_log_lines()}
            if args.tracemalloc:
                rss = {sample["minute"]: sample["rss_mib"] for sample in result["samples"]}
                result["tracemalloc"] = tracemalloc_growth(args.tracemalloc, result["snapshot_minutes"], rss)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
