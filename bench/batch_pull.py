"""Pulling a finished batch of long episodes: Arrow IPC stream vs JSON, through the real app.

N episodes of ~L response tokens each (random ids < 4096, a loss mask of 0/1 runs, float64
logprobs where the mask is 1, 0.0 elsewhere) are written through the storage layer (enqueue_batch,
claim_episodes, finish_episode) into a fresh SQLite database, then served by the app
(run_worker=False) over HTTP. Pulled as:
- Arrow: GET /batches/{id} with Accept: application/vnd.apache.arrow.stream (one request);
- JSON: GET /batches/{id}?include_tokens=true if the API supports it, else GET /episodes/{id} for
  every episode (the JSON path measured is named in the output).
Both are decoded to Python lists and compared on a sample of episodes (and against what was
written). Optionally the same on PostgreSQL (--postgres), in a database created and dropped here.

Run from the repo root:
    .venv/bin/python bench/batch_pull.py [--episodes 1024] [--tokens 8192] [--postgres]
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import pyarrow as pa

from service.app import create_app
from service.config import Settings
from service.records import EpisodeRequest, EpisodeResult, EpisodeStatus, TurnRecord
from service.serving import serve_app
from service.storage.batches import NewBatch, NewEpisode, enqueue_batch
from service.storage.db import Database, run_migrations
from service.storage.queue import claim_episodes, finish_episode

ARROW = "application/vnd.apache.arrow.stream"
PROMPT_TOKENS = 1500
VOCAB = 4096
SAMPLE_CHECKS = 16
WRITE_CHUNK = 64
POSTGRES_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"


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
                    **arrays,
                )
                assert await finish_episode(database.sessionmaker, "bench", claim.id, claim.attempt, result)
    finally:
        await database.dispose()
    return batch_id, written


def _arrays(row: dict[str, Any]) -> tuple[list[Any], ...]:
    return tuple(row[key] for key in ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs"))


async def pull(url: str, batch_id: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await client.get("/health")  # warm the connection
        started = time.perf_counter()
        response = await client.get(f"/batches/{batch_id}", headers={"Accept": ARROW})
        response.raise_for_status()
        arrow_fetch = time.perf_counter() - started
        table = pa.ipc.open_stream(io.BytesIO(response.content)).read_all()
        arrow_rows = {
            row["group_index"]: row
            for row in table.select(
                ["group_index", "episode_id", "prompt_ids", "response_ids", "loss_mask", "rollout_logprobs"]
            ).to_pylist()
        }
        arrow_seconds = time.perf_counter() - started
        arrow_bytes = len(response.content)

        started = time.perf_counter()
        response = await client.get(f"/batches/{batch_id}", params={"include_tokens": "true"})
        response.raise_for_status()
        body = response.json()
        json_bytes = len(response.content)
        if body["episodes"] and body["episodes"][0].get("response_ids") is not None:
            json_path = "GET /batches/{id}?include_tokens=true"
            json_rows = {episode["group_index"]: episode for episode in body["episodes"]}
        else:  # include_tokens not supported (yet): one request per episode
            json_path = "GET /episodes/{id} per episode"
            json_rows = {}
            semaphore = asyncio.Semaphore(8)

            async def fetch(episode_id: str) -> None:
                nonlocal json_bytes
                async with semaphore:
                    item = await client.get(f"/episodes/{episode_id}")
                item.raise_for_status()
                json_bytes += len(item.content)
                detail = item.json()
                json_rows[detail["group_index"]] = detail

            await asyncio.gather(*(fetch(episode["id"]) for episode in body["episodes"]))
        json_seconds = time.perf_counter() - started
    return {
        "arrow_rows": arrow_rows,
        "json_rows": json_rows,
        "arrow_seconds": arrow_seconds,
        "arrow_fetch_seconds": arrow_fetch,
        "arrow_bytes": arrow_bytes,
        "json_seconds": json_seconds,
        "json_bytes": json_bytes,
        "json_path": json_path,
    }


async def measure(database_url: str, episodes: int, tokens: int, seed: int) -> dict[str, Any]:
    started = time.perf_counter()
    batch_id, written = await write_batch(database_url, episodes, tokens, seed)
    write_seconds = time.perf_counter() - started
    warm_up_id, _ = await write_batch(database_url, 2, 64, seed + 2)
    settings = Settings(database_url=database_url, run_worker=False, api_keys="", log_level="WARNING")
    async with serve_app(create_app(settings)) as url:
        await pull(url, warm_up_id)  # first-request costs (imports, caches) of both paths
        pulled = await pull(url, batch_id)
    arrow_rows, json_rows = pulled["arrow_rows"], pulled["json_rows"]
    if set(arrow_rows) != set(written) or set(json_rows) != set(written):
        raise AssertionError(
            f"episodes missing: wrote {len(written)}, arrow {len(arrow_rows)}, json {len(json_rows)}"
        )
    sample = random.Random(seed + 1).sample(sorted(written), min(SAMPLE_CHECKS, len(written)))
    for group in sample:
        expected = _arrays(written[group])
        if _arrays(arrow_rows[group]) != expected:
            raise AssertionError(f"Arrow arrays of group {group} differ from what was stored")
        if _arrays(json_rows[group]) != expected:
            raise AssertionError(f"JSON arrays of group {group} differ from what was stored")
    response_tokens = sum(len(arrays["response_ids"]) for arrays in written.values())
    prompt_tokens = sum(len(arrays["prompt_ids"]) for arrays in written.values())
    # Useful payload: the token arrays as binary (int32 ids, uint8 mask, float64 logprobs).
    payload_bytes = prompt_tokens * 4 + response_tokens * (4 + 1 + 8)
    arrow_s, json_s = pulled["arrow_seconds"], pulled["json_seconds"]
    return {
        "write_s": round(write_seconds, 2),
        "arrow_bytes": pulled["arrow_bytes"],
        "arrow_s": round(arrow_s, 3),
        "arrow_fetch_s": round(pulled["arrow_fetch_seconds"], 3),
        "arrow_mb_per_s": round(pulled["arrow_bytes"] / arrow_s / 1e6, 1),
        "arrow_payload_mb_per_s": round(payload_bytes / arrow_s / 1e6, 1),
        "json_path": pulled["json_path"],
        "json_bytes": pulled["json_bytes"],
        "json_s": round(json_s, 3),
        "json_mb_per_s": round(pulled["json_bytes"] / json_s / 1e6, 1),
        "json_payload_mb_per_s": round(payload_bytes / json_s / 1e6, 1),
        "ratio": round(json_s / arrow_s, 2),
        "size_ratio": round(pulled["json_bytes"] / pulled["arrow_bytes"], 2),
        "payload_bytes": payload_bytes,
        "verified_episodes": len(sample),
    }


async def postgres_database() -> tuple[str, str]:
    import asyncpg

    name = f"bench_pull_{uuid.uuid4().hex[:8]}"
    connection = await asyncpg.connect(POSTGRES_ADMIN, timeout=5)
    try:
        await connection.execute(f'CREATE DATABASE "{name}"')
    finally:
        await connection.close()
    return name, f"postgresql+asyncpg://postgres@127.0.0.1:5432/{name}"


async def drop_postgres_database(name: str) -> None:
    import asyncpg

    connection = await asyncpg.connect(POSTGRES_ADMIN, timeout=5)
    try:
        await connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await connection.close()


def run_bench(
    episodes: int = 1024, tokens: int = 8192, postgres: bool = False, seed: int = 7
) -> dict[str, Any]:
    result: dict[str, Any] = {"episodes": episodes, "response_tokens": tokens, "prompt_tokens": PROMPT_TOKENS}
    with tempfile.TemporaryDirectory(prefix="bench-pull-") as tmp:
        url = f"sqlite+aiosqlite:///{tmp}/bench.db"
        run_migrations(url)
        result.update(asyncio.run(measure(url, episodes, tokens, seed)))
    if postgres:
        try:
            name, url = asyncio.run(postgres_database())
        except (OSError, Exception) as error:  # no server: say so, do not fail the bench
            result["postgres"] = {"error": f"{type(error).__name__}: {error}"}
        else:
            try:
                run_migrations(url)
                result["postgres"] = asyncio.run(measure(url, episodes, tokens, seed))
            finally:
                asyncio.run(drop_postgres_database(name))
    return result


def _lines(label: str, r: dict[str, Any]) -> list[str]:
    return [
        f"[{label}] stored in {r['write_s']:.1f} s; useful payload {r['payload_bytes'] / 1e6:.1f} MB",
        f"  Arrow  {r['arrow_bytes'] / 1e6:8.1f} MB in {r['arrow_s']:.2f} s "
        f"({r['arrow_fetch_s']:.2f} s HTTP)  {r['arrow_mb_per_s']:.1f} MB/s",
        f"  JSON   {r['json_bytes'] / 1e6:8.1f} MB in {r['json_s']:.2f} s  {r['json_mb_per_s']:.1f} MB/s"
        f"  via {r['json_path']}",
        f"  ratio  JSON/Arrow time {r['ratio']:.1f}x, size {r['size_ratio']:.1f}x; "
        f"{r['verified_episodes']} episodes verified identical in both",
    ]


def report(r: dict[str, Any]) -> str:
    lines = [
        f"{r['episodes']} episodes x {r['response_tokens']} response tokens "
        f"(+{r['prompt_tokens']} prompt tokens), times include decoding to Python lists"
    ]
    lines += _lines("sqlite", r)
    postgres = r.get("postgres")
    if isinstance(postgres, dict) and "error" in postgres:
        lines.append(f"[postgres] skipped: {postgres['error']}")
    elif postgres:
        lines += _lines("postgres", postgres)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--episodes", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--postgres", action="store_true", help="also measure on the local PostgreSQL")
    parser.add_argument("--quick", action="store_true", help="16 episodes x 512 tokens (smoke test)")
    args = parser.parse_args(argv)
    if args.quick:
        args.episodes, args.tokens = 16, 512
    result = run_bench(args.episodes, args.tokens, args.postgres)
    print(report(result))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
