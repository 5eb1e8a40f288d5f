"""`python -m service demo`: one batch end to end on the embedded default.

SQLite, a simulated SGLang worker, the built-in shop environment, the real service over HTTP: the
batch is submitted, followed with a progress bar, pulled as Arrow and summarized.
"""

from __future__ import annotations

import asyncio
import io
import sys
import time
from pathlib import Path
from statistics import mean
from typing import Literal

import httpx
import pyarrow as pa
from pydantic import SecretStr

from service.app import create_app
from service.config import Settings
from service.serving import serve_app
from service.sim.worker import SimConfig, create_sim_app, serve_in_thread
from service.storage.db import async_url, run_migrations

ENV = "builtin/shop"
PROGRESS_WIDTH = 40


def _bar(done: int, total: int, counts: dict[str, int], elapsed: float) -> str:
    filled = PROGRESS_WIDTH * done // max(total, 1)
    statuses = " ".join(f"{status} {count}" for status, count in counts.items() if count)
    return f"\r[{'#' * filled}{'.' * (PROGRESS_WIDTH - filled)}] {done}/{total}  {elapsed:5.1f}s  {statuses}"


def summarize(table: pa.Table, counts: dict[str, int], elapsed: float) -> str:
    rows = table.to_pylist()
    # What GRPO trains on: the rewards of played episodes (aborted and failed ones are dropped).
    trained = [row for row in rows if row["status"] in ("completed", "truncated")]
    groups: dict[int, list[float]] = {row["group_index"]: [] for row in rows}
    for row in trained:
        groups[row["group_index"]].append(row["reward"])
    sampled = sum(sum(row["loss_mask"]) for row in rows)
    response = sum(len(row["response_ids"]) for row in rows)
    prompt = sum(len(row["prompt_ids"]) for row in rows)
    turns = sum(row["num_turns"] or 0 for row in rows)
    mixed = sum(1 for rewards in groups.values() if len(set(rewards)) > 1)
    lines = [
        "",
        f"episodes   {len(rows)} in {len(groups)} groups, {elapsed:.1f}s "
        f"({len(rows) / elapsed:.1f} episodes/s)",
        "statuses   " + ", ".join(f"{status} {count}" for status, count in counts.items() if count),
        f"reward     mean {mean(row['reward'] for row in trained) if trained else 0.0:.3f} over "
        f"{len(trained)} completed or truncated; {mixed} of {len(groups)} groups have mixed rewards "
        "(a GRPO signal)",
        f"tokens     prompt {prompt}, response {response} ({sampled} sampled, loss mask 1; "
        f"{response - sampled} template, tool and user tokens, mask 0); {turns} turns",
    ]
    return "\n".join(lines)


async def _run(settings: Settings, tasks: int, samples: int) -> int:
    async with serve_app(create_app(settings)) as url, httpx.AsyncClient(base_url=url, timeout=60) as client:
        body = {
            "env": ENV,
            "task_split": "test",
            "task_indices": list(range(tasks)),
            "samples_per_task": samples,
            "sampling_params": {"temperature": 1.0, "max_new_tokens": 256},
            "max_turns": 12,
            "metadata": {"source": "python -m service demo"},
        }
        response = await client.post("/episodes", json=body)
        response.raise_for_status()
        batch_id = response.json()["batch_id"]
        print(f"submitted batch {batch_id}: {tasks} tasks x {samples} samples of {ENV}")
        started = time.monotonic()
        while True:
            batch = (await client.get(f"/batches/{batch_id}", params={"wait": 0.5})).json()
            elapsed = time.monotonic() - started
            sys.stdout.write(_bar(batch["finished"], batch["total"], batch["counts"], elapsed))
            sys.stdout.flush()
            if batch["complete"]:
                break
        arrow = await client.get(
            f"/batches/{batch_id}", headers={"Accept": "application/vnd.apache.arrow.stream"}
        )
        table = pa.ipc.open_stream(io.BytesIO(arrow.content)).read_all()
        print(summarize(table, batch["counts"], elapsed))
        print(f"pulled     {table.num_rows} rows as Arrow ({len(arrow.content) / 1e6:.2f} MB) from {url}")
        print(
            f"look at it: DATABASE_URL={settings.database_url} {python_command()} -m service serve, then "
            f"http://127.0.0.1:8000/ui/#/batches/{batch_id}"
        )
        return 0 if batch["counts"]["failed"] == 0 else 1


ENGINE_NAMES = {"sglang": "SGLang", "vllm": "vLLM"}
NO_KEYS = SecretStr("")  # the demo's service is its own, in this process: open, whatever the environment sets


def python_command() -> str:
    """The python that runs this (the venv's, where the service is installed), as a path to type:
    relative to the working directory when it is under it (`.venv/bin/python`)."""
    executable = Path(sys.executable)
    try:
        return str(executable.relative_to(Path.cwd()))
    except ValueError:
        return str(executable)


def run_demo(
    *,
    database_url: str,
    tasks: int,
    samples: int,
    engine: Literal["sglang", "vllm"] = "sglang",
    engine_url: str | None = None,
) -> int:
    database_url = async_url(database_url)
    run_migrations(database_url)
    if engine_url is not None:  # a real engine (scripts/demo_vllm.sh starts one)
        settings = Settings(
            database_url=database_url,
            sglang_url=engine_url,
            engine=engine,
            api_keys=NO_KEYS,
            api_projects=NO_KEYS,
        )
        print(f"database {database_url}; {ENGINE_NAMES[engine]} at {engine_url}")
        return asyncio.run(_run(settings, tasks, samples))
    with serve_in_thread(create_sim_app(SimConfig(latency_seconds=0.05))) as sim_url:
        settings = Settings(
            database_url=database_url,
            sglang_url=sim_url,
            engine=engine,
            api_keys=NO_KEYS,
            api_projects=NO_KEYS,
        )
        print(f"database {database_url}; simulated {ENGINE_NAMES[engine]} worker at {sim_url}")
        return asyncio.run(_run(settings, tasks, samples))
