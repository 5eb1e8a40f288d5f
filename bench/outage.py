"""A PostgreSQL outage mid-batch: how much finished work it costs.

Two service apps (each its own worker, writer and pool: two processes' worth) run in this process
on one PostgreSQL database reached through a TCP proxy, against the simulated SGLang worker. Once
every episode of the batch is past its first turn, the proxy cuts the database off (open
connections reset, new ones refused) for --outage seconds, then restores it. Measured: episodes
that ran again (attempt > 0), failed attempts counted (`failures`), results that were finished
during the outage and held until it ended, what /ready and GET /batches answered meanwhile, and how
long after the outage the batch completed.

Run from the repo root:
    .venv/bin/python bench/outage.py [--outage 30] [--episodes 64]
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections import Counter
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
from sqlalchemy import select  # noqa: E402
from sqlalchemy.engine import make_url  # noqa: E402

from bench.common import fresh_database, run_loop  # noqa: E402
from service.app import create_app  # noqa: E402
from service.config import Settings  # noqa: E402
from service.records import FINISHED_STATUSES  # noqa: E402
from service.serving import serve_app  # noqa: E402
from service.sim.worker import SimConfig, SimWorker, create_sim_app, serve_in_thread  # noqa: E402
from service.storage.db import Database  # noqa: E402
from service.storage.models import Episode  # noqa: E402
from tests.support.polling import until  # noqa: E402
from tests.support.tcp_proxy import TcpProxy  # noqa: E402

LEASE_SECONDS = 5.0
GOAL = "0 episodes re-run and 0 failures after a 30 s outage"


async def episodes(database: Database, batch_id: str) -> list[Episode]:
    async with database.sessionmaker() as session:
        return list(await session.scalars(select(Episode).where(Episode.batch_id == batch_id)))


async def measure(database_url: str, episode_count: int, outage: float, latency: float) -> dict[str, Any]:
    url = make_url(database_url)
    proxy = TcpProxy(url.host or "127.0.0.1", url.port or 5432)
    sim = SimWorker(SimConfig(latency_seconds=latency))
    database = Database.open(database_url)  # the bench's own view, not through the proxy
    async with AsyncExitStack() as stack:
        stack.push_async_callback(database.dispose)
        await stack.enter_async_context(proxy.serving())
        sglang_url = stack.enter_context(serve_in_thread(create_sim_app(sim.config, worker=sim)))
        settings = Settings(
            database_url=url.set(port=proxy.port).render_as_string(hide_password=False),
            sglang_url=sglang_url,
            api_keys="",
            env_executor="thread",
            lease_seconds=LEASE_SECONDS,
            tune_gc=False,
            log_level="WARNING",
        )
        first = await stack.enter_async_context(serve_app(create_app(settings)))
        await stack.enter_async_context(serve_app(create_app(settings)))
        http = await stack.enter_async_context(httpx.AsyncClient(base_url=first, timeout=30))
        samples = 4
        response = await http.post(
            "/episodes",
            json={
                "env": "builtin/shop",
                "task_split": "train",
                "task_indices": list(range(episode_count // samples)),
                "samples_per_task": samples,
                "sampling_params": {"temperature": 1.0, "max_new_tokens": 256},
                "max_turns": 12,
            },
        )
        response.raise_for_status()
        batch_id, total = response.json()["batch_id"], len(response.json()["episode_ids"])

        def all_started() -> bool:
            return len({r.rid.split(":")[0] for r in sim.requests}) == total

        await until(all_started, timeout_seconds=120)
        stored_before = sum(e.status in FINISHED_STATUSES for e in await episodes(database, batch_id))
        proxy.cut()
        answers: Counter[str] = Counter()
        cut_at = time.monotonic()
        while time.monotonic() - cut_at < outage:
            for path in ("/ready", f"/batches/{batch_id}"):
                answers[f"{path.split('/')[1]} {(await http.get(path)).status_code}"] += 1
            await asyncio.sleep(1.0)
        calls_at_restore = len(sim.requests)
        running_at_restore = {e.id for e in await episodes(database, batch_id) if e.status == "running"}
        proxy.restore()
        restored_at = time.monotonic()
        rows = await episodes(database, batch_id)
        while not all(e.status in FINISHED_STATUSES for e in rows):
            await asyncio.sleep(0.1)  # polling the database, as a trainer would
            rows = await episodes(database, batch_id)
        recovered = time.monotonic() - restored_at
    calls = Counter(r.rid.split(":")[0] for r in sim.requests[:calls_at_restore])
    held = sum(1 for e in rows if e.id in running_at_restore and calls[e.id] == e.num_turns)
    rerun = sum(1 for e in rows if e.attempt > 0)
    failures = sum(e.failures for e in rows)
    return {
        "episodes": total,
        "outage_s": outage,
        "lease_s": LEASE_SECONDS,
        "stored_before_outage": stored_before,
        "finished_during_outage_and_held": held,
        "rerun": rerun,
        "failures": failures,
        "statuses": dict(Counter(e.status for e in rows)),
        "answers_during_outage": dict(answers),
        "complete_s_after_restore": round(recovered, 2),
        "goal": GOAL,
        "goal_met": rerun == 0 and failures == 0 and outage >= 30,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--outage", type=float, default=30.0, help="seconds the database is cut off")
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--latency", type=float, default=0.5, help="the simulated engine's seconds per call")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, fresh_database("postgres", Path(tmp), migrate=True) as url:
        result = run_loop(measure(url, args.episodes, args.outage, args.latency))
    print(
        f"{result['episodes']} episodes, the database cut off for {result['outage_s']:.0f} s mid-batch "
        f"(lease {result['lease_s']:.0f} s): {result['finished_during_outage_and_held']} finished meanwhile "
        f"and were held; {result['rerun']} re-run, {result['failures']} failed attempts; complete "
        f"{result['complete_s_after_restore']} s after the restore; answers meanwhile "
        f"{result['answers_during_outage']}"
    )
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
