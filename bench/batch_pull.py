"""Pulling a finished batch of long episodes: Arrow IPC stream vs JSON with tokens, over real HTTP.

N episodes of ~L response tokens each (random ids < 4096, a loss mask of 0/1 runs, float64
logprobs where the mask is 1, 0.0 elsewhere) are written through the storage layer (enqueue_batch,
claim_episodes, finish_episode) into a fresh SQLite database (and, with --postgres, a PostgreSQL
database created and dropped here). The service then runs as its own process (`python -m service
serve`, API only) on that database, and this process, the client, pulls the batch as a trainer does:
- Arrow: GET /batches/{id} with Accept: application/vnd.apache.arrow.stream (--repeat times);
- JSON: GET /batches/{id}?include_tokens=true (once: it takes seconds).
Timed: the request until the last byte of the body arrived (MB/s are body bytes per second). The
decoding afterwards (Arrow to a pyarrow Table; JSON parsed) is timed apart and reported beside it.
Both bodies are checked against what was written on a sample of episodes. The service's peak RSS
during each pull is read from /proc (VmHWM after resetting it, or VmRSS sampled every 5 ms).

Run from the repo root:
    .venv/bin/python bench/batch_pull.py [--episodes 1024] [--tokens 8192] [--postgres]
`--server-root DIR` serves from another checkout (e.g. a `git worktree` of an older commit), so its
code is measured by the same client; `--profile FILE` runs the service under py-spy (raw stacks;
`--arrow-only` leaves out the JSON pull).
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import pyarrow as pa
import pyarrow.compute as pc

from bench.common import fresh_database, wait_healthy
from service.records import EpisodeRequest, EpisodeResult, EpisodeStatus, EpisodeTokens, TurnRecord
from service.storage.batches import NewBatch, NewEpisode, enqueue_batch
from service.storage.db import Database
from service.storage.queue import claim_episodes, finish_episode
from tests.support.ports import free_port

REPO = Path(__file__).resolve().parents[1]
ARROW = "application/vnd.apache.arrow.stream"
PROMPT_TOKENS = 1500
VOCAB = 4096
SAMPLE_CHECKS = 16
WRITE_CHUNK = 64
STOP_TIMEOUT_SECONDS = 30.0
RSS_SAMPLE_SECONDS = 0.005
# issue 10: from PostgreSQL, Arrow >= 10x JSON with tokens and >= 300 MB/s.
GOAL_RATIO = 10.0
GOAL_ARROW_MB_PER_S = 300.0


def make_episode(rng: random.Random, tokens: int) -> dict[str, list[Any]]:
    response = [rng.randrange(VOCAB) for _ in range(tokens)]
    mask: list[int] = []
    value = 0
    while len(mask) < tokens:  # runs: template/tool tokens (0) and sampled turns (1)
        mask.extend([value] * rng.randint(20, 400))
        value ^= 1
    mask = mask[:tokens]
    logprobs = [-rng.expovariate(2.0) if bit else 0.0 for bit in mask]
    prompt = [rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)]
    return {"prompt_ids": prompt, "response_ids": response, "loss_mask": mask, "rollout_logprobs": logprobs}


async def write_batch(database_url: str, episodes: int, tokens: int, seed: int) -> tuple[str, dict[int, Any]]:
    """Stores a finished batch; returns its id and the arrays written, by group index."""
    database = Database.open(database_url)
    rng = random.Random(seed)
    batch_id = f"bench-{uuid.uuid4().hex[:8]}"
    written: dict[int, Any] = {}
    try:
        async with database.sessionmaker.begin() as session:
            await enqueue_batch(
                session,
                NewBatch(
                    batch_id=batch_id,
                    request_hash="bench",
                    env="builtin/shop",
                    task_split="train",
                    metadata={"bench": "batch_pull"},
                    episodes=[
                        NewEpisode(
                            group,
                            0,
                            EpisodeRequest("builtin/shop", "train", group, {"max_new_tokens": 1024}, 30),
                        )
                        for group in range(episodes)
                    ],
                ),
            )
        while True:
            claims = await claim_episodes(database.sessionmaker, "bench", WRITE_CHUNK, 3600)
            if not claims:
                break
            for claim in claims:
                arrays = make_episode(rng, tokens)
                written[claim.group_index] = arrays
                turns = [
                    TurnRecord(k, "v1", {"type": "stop"}, output_tokens=0, engine_seconds=0.0)
                    for k in range(8)
                ]
                result = EpisodeResult(
                    status=EpisodeStatus.COMPLETED,
                    reward=rng.random(),
                    messages=[],
                    info={},
                    turns=turns,
                    tokens=EpisodeTokens(**arrays),
                )
                assert await finish_episode(database.sessionmaker, "bench", claim.id, claim.attempt, result)
    finally:
        await database.dispose()
    return batch_id, written


# ---- the service, as its own process ----


def _children(pid: int) -> list[int]:
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


@dataclass
class ServiceProcess:
    process: subprocess.Popen[bytes]
    url: str
    log: Path
    profiled: bool

    @property
    def pid(self) -> int:
        """The service's own pid (under py-spy, py-spy's child)."""
        if not self.profiled:
            return self.process.pid
        children = _children(self.process.pid)
        if not children:
            raise RuntimeError("py-spy has not started the service")
        return children[0]


@contextmanager
def service_process(
    root: Path, database_url: str, log_dir: Path, profile: Path | None
) -> Iterator[ServiceProcess]:
    """`python -m service serve` from the checkout at `root`, API only, on a free port."""
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(root),
        "DATABASE_URL": database_url,
        "RUN_WORKER": "false",
        "API_KEYS": "",
        "LOG_LEVEL": "WARNING",
    }
    command = [sys.executable, "-m", "service", "serve", "--host", "127.0.0.1", "--port", str(port)]
    if profile is not None:
        py_spy = Path(sys.executable).with_name("py-spy")
        command = [
            str(py_spy),
            "record",
            "--format",
            "raw",
            "--rate",
            "250",
            "-o",
            str(profile),
            "--",
            *command,
        ]
    log = log_dir / f"service-{port}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(command, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)
    service = ServiceProcess(process, f"http://127.0.0.1:{port}", log, profile is not None)
    try:
        wait_healthy(service.url, process, log)
        yield service
    finally:
        try:
            os.kill(service.pid, signal.SIGTERM)
        except (ProcessLookupError, RuntimeError):
            process.terminate()
        try:
            process.wait(STOP_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class PeakRss:
    """The peak resident set of process `pid` between start() and stop(), in bytes: VmHWM after
    resetting it (/proc/<pid>/clear_refs), and VmRSS sampled meanwhile in case the reset fails."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.sampled_kb = 0
        self.reset = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.sampled_kb = max(self.sampled_kb, _status_kb(self.pid, "VmRSS"))
            self._stop.wait(RSS_SAMPLE_SECONDS)

    def start(self) -> None:
        try:
            Path(f"/proc/{self.pid}/clear_refs").write_text("5")
            self.reset = True
        except OSError:
            self.reset = False
        self._thread.start()

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        peak_kb = self.sampled_kb
        if self.reset:
            peak_kb = max(peak_kb, _status_kb(self.pid, "VmHWM"))
        return peak_kb * 1024


@dataclass(frozen=True)
class Pull:
    body: bytes
    seconds: float
    peak_rss: int


def timed_get(client: httpx.Client, pid: int, path: str, **kwargs: Any) -> Pull:
    watch = PeakRss(pid)
    watch.start()
    try:
        started = time.perf_counter()
        response = client.get(path, **kwargs)
        body = response.content
        seconds = time.perf_counter() - started
    finally:
        peak = watch.stop()
    response.raise_for_status()
    return Pull(body, seconds, peak)


# ---- one backend ----


def _arrays(row: dict[str, Any]) -> tuple[list[Any], ...]:
    return tuple(row[key] for key in ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs"))


def _check(
    label: str, groups: list[int], rows: dict[int, Any], written: dict[int, Any], sample: list[int]
) -> None:
    if sorted(groups) != sorted(written):
        raise AssertionError(f"{label}: wrote {len(written)} episodes, pulled {len(groups)}")
    for group in sample:
        if _arrays(rows[group]) != _arrays(written[group]):
            raise AssertionError(f"{label} arrays of group {group} differ from what was stored")


def pull_and_check(
    url: str,
    pid: int,
    batch_id: str,
    warm_up_id: str,
    written: dict[int, Any],
    *,
    repeat: int,
    arrow_only: bool,
    seed: int,
) -> dict[str, Any]:
    sample = random.Random(seed + 1).sample(sorted(written), min(SAMPLE_CHECKS, len(written)))
    with httpx.Client(base_url=url, timeout=600) as client:
        # First-request costs (imports, caches) of both paths, on a small batch.
        timed_get(client, pid, f"/batches/{warm_up_id}", headers={"Accept": ARROW})
        timed_get(client, pid, f"/batches/{warm_up_id}", params={"include_tokens": "true"})
        rss_before = _status_kb(pid, "VmRSS") * 1024
        arrow_pulls = [
            timed_get(client, pid, f"/batches/{batch_id}", headers={"Accept": ARROW}) for _ in range(repeat)
        ]
        json_pull = None
        if not arrow_only:
            json_pull = timed_get(client, pid, f"/batches/{batch_id}", params={"include_tokens": "true"})

    started = time.perf_counter()
    table = pa.ipc.open_stream(io.BytesIO(arrow_pulls[-1].body)).read_all()
    arrow_decode = time.perf_counter() - started
    picked = table.filter(pc.is_in(table["group_index"], pa.array(sample, pa.int32())))
    arrow_rows = {row["group_index"]: row for row in picked.to_pylist()}
    _check("Arrow", table["group_index"].to_pylist(), arrow_rows, written, sample)
    if any(pull.body != arrow_pulls[0].body for pull in arrow_pulls):
        raise AssertionError("repeated Arrow pulls differ")

    arrow_bytes = len(arrow_pulls[0].body)
    arrow_seconds = statistics.median(pull.seconds for pull in arrow_pulls)
    response_tokens = sum(len(arrays["response_ids"]) for arrays in written.values())
    prompt_tokens = sum(len(arrays["prompt_ids"]) for arrays in written.values())
    # Useful payload: the token arrays as binary (int32 ids, uint8 mask, float64 logprobs).
    payload_bytes = prompt_tokens * 4 + response_tokens * (4 + 1 + 8)
    result = {
        "arrow_bytes": arrow_bytes,
        "arrow_s": round(arrow_seconds, 3),
        "arrow_runs_s": [round(pull.seconds, 3) for pull in arrow_pulls],
        "arrow_mb_per_s": round(arrow_bytes / arrow_seconds / 1e6, 1),
        "arrow_best_mb_per_s": round(arrow_bytes / min(pull.seconds for pull in arrow_pulls) / 1e6, 1),
        "arrow_decode_s": round(arrow_decode, 3),
        "arrow_peak_rss_mb": round(max(pull.peak_rss for pull in arrow_pulls) / 1e6, 1),
        "payload_bytes": payload_bytes,
        "payload_mb_per_s": round(payload_bytes / arrow_seconds / 1e6, 1),
        "service_rss_mb": round(rss_before / 1e6, 1),
        "verified_episodes": len(sample),
    }
    if json_pull is None:
        return result
    started = time.perf_counter()
    body = json.loads(json_pull.body)
    json_decode = time.perf_counter() - started
    json_rows = {episode["group_index"]: episode for episode in body["episodes"]}
    _check("JSON", [episode["group_index"] for episode in body["episodes"]], json_rows, written, sample)
    json_bytes = len(json_pull.body)
    return result | {
        "json_path": "GET /batches/{id}?include_tokens=true",
        "json_bytes": json_bytes,
        "json_s": round(json_pull.seconds, 3),
        "json_mb_per_s": round(json_bytes / json_pull.seconds / 1e6, 1),
        "json_decode_s": round(json_decode, 3),
        "json_peak_rss_mb": round(json_pull.peak_rss / 1e6, 1),
        "ratio": round(json_pull.seconds / arrow_seconds, 2),
        # What a trainer waits for: the body fetched and turned into arrays it can use.
        "ratio_with_decode": round(
            (json_pull.seconds + json_decode) / (arrow_seconds + result["arrow_decode_s"]), 2
        ),
        "size_ratio": round(json_bytes / arrow_bytes, 2),
    }


def measure(
    database_url: str,
    episodes: int,
    tokens: int,
    seed: int,
    *,
    repeat: int,
    arrow_only: bool,
    server_root: Path,
    profile: Path | None,
) -> dict[str, Any]:
    started = time.perf_counter()
    batch_id, written = asyncio.run(write_batch(database_url, episodes, tokens, seed))
    write_seconds = time.perf_counter() - started
    warm_up_id, _ = asyncio.run(write_batch(database_url, 2, 64, seed + 2))
    with tempfile.TemporaryDirectory(prefix="bench-pull-logs-") as logs:
        with service_process(server_root, database_url, Path(logs), profile) as service:
            result = pull_and_check(
                service.url,
                service.pid,
                batch_id,
                warm_up_id,
                written,
                repeat=repeat,
                arrow_only=arrow_only,
                seed=seed,
            )
    return {"write_s": round(write_seconds, 2), **result}


def _profile_path(profile: Path | None, backend: str) -> Path | None:
    return None if profile is None else profile.with_name(f"{profile.stem}-{backend}{profile.suffix}")


def run_bench(
    episodes: int = 1024,
    tokens: int = 8192,
    postgres: bool = False,
    seed: int = 7,
    *,
    repeat: int = 5,
    arrow_only: bool = False,
    server_root: Path = REPO,
    profile: Path | None = None,
) -> dict[str, Any]:
    result: dict[str, Any] = {
        "episodes": episodes,
        "response_tokens": tokens,
        "prompt_tokens": PROMPT_TOKENS,
        "server_root": str(server_root),
    }
    options: dict[str, Any] = {"repeat": repeat, "arrow_only": arrow_only, "server_root": server_root}
    with tempfile.TemporaryDirectory(prefix="bench-pull-") as tmp:
        with fresh_database("sqlite", Path(tmp), migrate=True) as url:
            result.update(
                measure(url, episodes, tokens, seed, profile=_profile_path(profile, "sqlite"), **options)
            )
        if postgres:
            with fresh_database("postgres", Path(tmp), migrate=True) as url:
                result["postgres"] = measure(
                    url, episodes, tokens, seed, profile=_profile_path(profile, "postgres"), **options
                )
            postgres_result = result["postgres"]
            if not arrow_only:
                result["goal_met"] = (
                    postgres_result["ratio"] >= GOAL_RATIO
                    and postgres_result["arrow_mb_per_s"] >= GOAL_ARROW_MB_PER_S
                )
    return result


def _lines(label: str, r: dict[str, Any]) -> list[str]:
    runs = ", ".join(f"{seconds:.2f}" for seconds in r["arrow_runs_s"])
    lines = [
        f"[{label}] stored in {r['write_s']:.1f} s; useful payload {r['payload_bytes'] / 1e6:.1f} MB; "
        f"service RSS {r['service_rss_mb']:.0f} MB before the pulls",
        f"  Arrow  {r['arrow_bytes'] / 1e6:8.1f} MB in {r['arrow_s']:.3f} s (median of {runs}) "
        f"{r['arrow_mb_per_s']:7.1f} MB/s; peak RSS {r['arrow_peak_rss_mb']:.0f} MB; "
        f"decoded to a Table in {r['arrow_decode_s']:.3f} s",
    ]
    if "json_s" not in r:
        return lines
    return [
        *lines,
        f"  JSON   {r['json_bytes'] / 1e6:8.1f} MB in {r['json_s']:.3f} s {r['json_mb_per_s']:7.1f} MB/s; "
        f"peak RSS {r['json_peak_rss_mb']:.0f} MB; parsed in {r['json_decode_s']:.3f} s; "
        f"via {r['json_path']}",
        f"  ratio  JSON/Arrow time {r['ratio']:.1f}x ({r['ratio_with_decode']:.1f}x with decoding), "
        f"size {r['size_ratio']:.1f}x; "
        f"{r['verified_episodes']} episodes verified in both",
    ]


def report(r: dict[str, Any]) -> str:
    lines = [
        f"{r['episodes']} episodes x {r['response_tokens']} response tokens "
        f"(+{r['prompt_tokens']} prompt tokens), served from {r['server_root']} by its own process; "
        "times are the HTTP fetch to the last byte"
    ]
    lines += _lines("sqlite", r)
    postgres = r.get("postgres")
    if isinstance(postgres, dict) and "error" in postgres:
        lines.append(f"[postgres] skipped: {postgres['error']}")
    elif postgres:
        lines += _lines("postgres", postgres)
    if "goal_met" in r:
        lines.append(
            f"goal (PostgreSQL: Arrow >= {GOAL_RATIO:g}x JSON and >= {GOAL_ARROW_MB_PER_S:g} MB/s): "
            f"{'met' if r['goal_met'] else 'NOT met'}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--episodes", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--postgres", action="store_true", help="also measure on the local PostgreSQL")
    parser.add_argument("--quick", action="store_true", help="16 episodes x 512 tokens (smoke test)")
    parser.add_argument("--repeat", type=int, default=5, help="Arrow pulls (the median is reported)")
    parser.add_argument("--arrow-only", action="store_true", help="no JSON pull (e.g. to profile)")
    parser.add_argument("--server-root", type=Path, default=REPO, help="the checkout to serve from")
    parser.add_argument("--profile", type=Path, default=None, help="py-spy raw stacks to FILE-<backend>")
    args = parser.parse_args(argv)
    if args.quick:
        args.episodes, args.tokens = 16, 512
    result = run_bench(
        args.episodes,
        args.tokens,
        args.postgres,
        repeat=args.repeat,
        arrow_only=args.arrow_only,
        server_root=args.server_root.resolve(),
        profile=args.profile,
    )
    print(report(result))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
